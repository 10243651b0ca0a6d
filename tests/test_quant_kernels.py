"""The quantized matmul kernels (kvserve/csrc/quant*.cpp): the GGUF formats against gguf-py's dequantization then
a matmul, on random blocks of every format, odd shapes and 1..300 rows; INT8 (--quantization int8) bit for bit
against its definition in integers; on the native and the portable build (and, on CPUs with AVX-512 VNNI, the
native build against the one without AVX-512, bit for bit)."""
import dataclasses

import numpy as np
import pytest
import torch

from kvserve import kernels
from kvserve.model.quantization import (INT8_GROUP, KERNEL_FORMATS, FORMAT_IDS, OCTETS, QuantizedTensor,
                                        QuantizedWeight, embedding_rows, int8_act_group, int8_row_bytes,
                                        quantize_for_int8, quantize_int8, quantized_matmul)

# byte offsets of each format's fp16 fields (scales and mins): random bytes there would be NaN or huge
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_XS": (0,),
                "IQ4_NL": (0,)}
QK_FORMATS = ("Q2_K", "Q3_K", "Q5_K", "IQ4_XS")   # x quantized per 128 values for these, per 32 for the others


def superblocks(fmt: str) -> bool:
    """A format of 256-value blocks (the K-quants, IQ4_XS): rows of whole ones."""
    return KERNEL_FORMATS[FORMAT_IDS[fmt]][1] == 256


def random_quantized(fmt: str, rows: int, cols: int, seed: int = 0) -> QuantizedTensor:
    """A [rows, cols] matrix of random blocks of `fmt`, with scales of the size real weights have."""
    tid = FORMAT_IDS[fmt]
    _, per_block, nbytes = KERNEL_FORMATS[tid]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // per_block, nbytes), dtype=np.uint8)
    for off in _FP16_FIELDS[fmt]:
        scale = 0.05 if superblocks(fmt) else 0.2   # K-quants and IQ4_XS multiply by 6/8-bit sub-scales
        d = (rng.uniform(-1, 1, size=blocks.shape[:2]) * scale / (32 if superblocks(fmt) else 8))
        blocks[:, :, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return QuantizedTensor(tid, torch.from_numpy(blocks.reshape(rows, -1)), cols)


def reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    return (x.double() @ weight.dequantize().double().T)


def check_close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group: int = 32):
    # quantizing x to int8 per `group` values (32; 128 for QK_FORMATS) moves each value by
    # at most half a step (its block's max |x| / 254)
    amax = x.abs().double().reshape(x.shape[0], -1, group).amax(-1, keepdim=True)
    step = (amax / 254).expand(-1, -1, group).reshape(x.shape)
    bound = step @ w.abs().double().T * 1.001 + 1e-5
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, bound {bound.min():.3g}"
    rel = err.norm() / ref.norm()
    assert rel < 0.02, rel


@pytest.mark.parametrize("fmt", sorted(FORMAT_IDS))
@pytest.mark.parametrize("variant", ["native", "portable"])
def test_every_format_against_dequantized_matmul(fmt, variant):
    k = 512 if superblocks(fmt) else 352   # 32-value formats: 11 blocks, a whole octet and a partial one
    with kernels.variant(variant) as lib:
        if lib is None:
            pytest.skip("no C++ kernels")
        w = QuantizedWeight([random_quantized(fmt, 37, k, seed=1)])
        dense = w.dequantize()
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 64, 300):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            x[:, 128:256] *= 8   # the two activation scales of a QK_FORMATS block differ
            y = quantized_matmul(x, w)
            assert y.dtype == torch.float32 and y.shape == (rows, 37)
            check_close(y, reference(x, w), x, dense, 128 if fmt in QK_FORMATS else 32)   # the others: per 32


@pytest.mark.parametrize("fmt,k", [("Q4_K", 256), ("Q4_K", 512), ("Q5_K", 256), ("Q6_K", 256),
                                     ("Q2_K", 512), ("Q3_K", 512), ("IQ4_XS", 512)]
                         + [(f, k) for f in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL") for k in (352, 512)]
                         + [("Q4_K", 8960), ("Q6_K", 8960), ("Q4_1", 8032), ("Q8_0", 8000)])
def test_rows_of_a_step_are_independent(fmt, k):
    # a row's result does not depend on which other rows share its step (row tiles of 8, remainders) nor on the
    # weight rows beside it (Q4_0, Q4_1 and Q4_K run whole octets two weight rows at a time in the row tiles after
    # the first, x rows in passes of up to 4: here tiles of 8, 8 and 3 rows; an odd weight row runs alone); for the
    # 32-value formats 11 blocks (an octet and a partial one) or 16; steps of 10, 13, 14 and 19 rows pair 2 rows
    # of x, 3 + 2, 3 + 3, and 4 + 4 then 3. Long rows (K of 8000-8960, as Qwen2.5-Coder-1.5B's ffn_down): 2 rows of
    # x or more overflow L1, and the rows read one at a time go in runs of octets (quant_matmul.cpp's rows_in_runs;
    # 8032: a partial last octet in the last run; 8000: a last group of 2 blocks shared across rows)
    raw = random_quantized(fmt, 21, k)
    w = QuantizedWeight([raw])
    x = torch.randn(19, k)
    whole = quantized_matmul(x, w)
    for m in (10, 13, 14):
        assert torch.equal(quantized_matmul(x[:m], w), whole[:m])
    for i in range(19):
        assert torch.equal(quantized_matmul(x[i:i + 1], w), whole[i:i + 1])
    for n in (0, 7, 20):
        alone = QuantizedWeight([dataclasses.replace(raw, data=raw.data[n:n + 1])])
        assert torch.equal(quantized_matmul(x, alone)[:, 0], whole[:, n])
    check_close(whole, reference(x, w), x, w.dequantize(), 128 if fmt in QK_FORMATS else 32)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"])
@pytest.mark.parametrize("blocks", [17, 18, 20])
def test_rows_sharing_their_last_group_keep_their_own_results(fmt, blocks):
    # a row whose last group has 1, 2 or 4 blocks runs that group in one octet with those of the next 7, 3 or 1
    # rows (AVX2): each row's result is the same whichever rows share it (alone, or among 21 rows at the start,
    # middle and end: the last one shares a short group), each x row's the same in a step of 1 or of 11 rows, and
    # all close to the dequantized matmul
    k = 32 * blocks
    raw = random_quantized(fmt, 21, k, seed=blocks)
    w = QuantizedWeight([raw])
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(blocks))
    whole = quantized_matmul(x, w)
    check_close(whole, reference(x, w), x, w.dequantize())
    for i in (0, 5, 20):
        alone = QuantizedWeight([dataclasses.replace(raw, data=raw.data[i:i + 1])])
        assert torch.equal(quantized_matmul(x, alone)[:, 0], whole[:, i])
    for r in range(11):
        assert torch.equal(quantized_matmul(x[r:r + 1], w), whole[r:r + 1])


@pytest.mark.parametrize("fmt", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                 "Q8_0", "IQ4_NL"])
def test_native_and_portable_agree_on_the_integer_sums(fmt):
    # same quantized activations and exact integer dot products: only float rounding differs, on the scale of the
    # terms summed (a result near cancellation differs relatively more), over many random inputs; 32-value
    # formats: 11 blocks, an octet and a partial one
    k = 512 if superblocks(fmt) else 352
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(4))
    outs = []
    for variant in ("native", "portable"):
        with kernels.variant(variant) as lib:
            if lib is None:
                pytest.skip("no C++ kernels")
            w = QuantizedWeight([random_quantized(fmt, 33, k, seed=3)])   # bound to the variant's kernels
            outs.append(quantized_matmul(x, w).double())
    scale = x.abs().double() @ w.dequantize().abs().double().T
    diff = (outs[0] - outs[1]).abs()
    assert (diff <= 1e-6 * scale).all(), (diff / scale).max()
    assert (diff > 0).any()   # the paths do differ in their float steps: the bound is what is tested


@pytest.mark.parametrize("fmt", sorted(FORMAT_IDS))
def test_avx512_vnni_and_avx2_builds_agree_bit_for_bit(fmt):
    # AVX-512 VNNI's dot products (vpdpbusd, vpdpwssd) make the AVX2 path's integers, and the same float steps
    # follow: the native build and the one without AVX-512 give the same bits, at every row tile (1-8 rows from
    # memory, the later tiles of 10-17 rows from cache: the 4-bit formats' paired rows where octets are whole)
    native = kernels.load_variant("native")
    if native is None or native.kvserve_quant_simd() != 2:
        pytest.skip("no AVX-512 VNNI on this CPU: its native build is the AVX2 one")
    # 32-value formats: 11 blocks (a partial octet), 16 (whole ones), 17, 18, 20 (last groups of 1, 2, 4 blocks
    # shared across rows); long rows, whose rows of x from 2 on go in runs of octets (rows_in_runs): 8960 values,
    # and 8032, 8000, 8224 (a partial last octet; last groups of 2 and 1 blocks)
    shapes = (512, 8960) if superblocks(fmt) else (352, 512, 544, 576, 640, 8032, 8000, 8224)
    x = torch.randn(17, 8960, generator=torch.Generator().manual_seed(5))
    outs = {}
    for variant in ("native", "no-avx512"):
        with kernels.variant(variant) as lib:
            assert lib is not None and lib.kvserve_quant_simd() == (2 if variant == "native" else 1)
            for k in shapes:
                w = QuantizedWeight([random_quantized(fmt, 33, k, seed=k)])   # bound to the variant's kernels
                for rows in (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 17):
                    outs.setdefault((k, rows), []).append(quantized_matmul(x[:rows, :k], w))
    for (k, rows), (a, b) in outs.items():
        assert torch.equal(a, b), (k, rows, (a - b).abs().max())


@pytest.mark.parametrize("fmt", sorted(FORMAT_IDS))
def test_avx512_vnni_and_avx2_builds_agree_on_non_finite_activations(fmt):
    # rows with a NaN, an infinity, or a block whose largest value is so small that 127 / amax overflows: their
    # results are garbage, but the same garbage on both builds. The activations' bytes are clamped to -127..127
    # (a NaN, or a product past the int32 range, made -128 bytes beside sums that wrapped, and the signed formats'
    # VNNI path, which takes those sums off, then disagreed with AVX2's sign trick)
    native = kernels.load_variant("native")
    if native is None or native.kvserve_quant_simd() != 2:
        pytest.skip("no AVX-512 VNNI on this CPU: its native build is the AVX2 one")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 64:96] = 1e-37 * torch.sign(x[2, 64:96])
    x[3, 130] = -float("inf")
    outs = []
    for variant in ("native", "no-avx512"):
        with kernels.variant(variant):
            w = QuantizedWeight([random_quantized(fmt, 33, 512, seed=2)])   # bound to the variant's kernels
            outs.append(quantized_matmul(x, w))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(outs[0][4]).all()   # a finite row beside them is untouched


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("variant", ["native", "portable"])
def test_activations_round_half_to_even(fmt, variant):
    # x is quantized per 32 values with the scale amax / 127: a block whose largest value is 127 keeps its values'
    # scale at 1, so values at .5 show the rounding (0.5 -> 0, 2.5 -> 2, 4.5 -> 4; away from zero would give 1, 3,
    # 5, truncation 1 and 2 for 1.7 and 2.7). Weights all 1: Q8_0 d 1, q 1; Q4_1 d 1, min 1, q 0 (through the
    # activations' sum). Every product and sum is exact on both builds
    with kernels.variant(variant) as lib:
        if lib is None:
            pytest.skip("no C++ kernels")
        one = np.array([1.0], np.float16).view(np.uint8)
        block = np.concatenate([one, np.ones(32, np.uint8)]) if fmt == "Q8_0" else \
            np.concatenate([one, one, np.zeros(16, np.uint8)])
        w = QuantizedWeight([QuantizedTensor(FORMAT_IDS[fmt], torch.from_numpy(block[None].copy()), 32)])
        x = torch.zeros(1, 32)
        x[0, :6] = torch.tensor([127, 0.5, 2.5, 4.5, 1.7, 2.7])
        assert quantized_matmul(x, w).item() == 127 + 0 + 2 + 4 + 2 + 3
        assert quantized_matmul(x.bfloat16(), w).item() == 127 + 0 + 2 + 4 + 2 + 3   # 1.7, 2.7 as bf16 round alike


def test_mixed_segments_stack_their_outputs():
    # a fused q|k|v of a Q4_K_M file: Q4_K, Q4_K, Q6_K; the neighbours of one format share one segment
    parts = [random_quantized("Q4_K", 16, 256, 1), random_quantized("Q4_K", 8, 256, 2),
             random_quantized("Q6_K", 8, 256, 3)]
    w = QuantizedWeight(parts)
    assert w.formats() == ["Q4_K", "Q6_K"] and w.out_features == 32
    x = torch.randn(3, 256)
    y = quantized_matmul(x, w)
    for part, cols in zip(parts, (slice(0, 16), slice(16, 24), slice(24, 32))):
        torch.testing.assert_close(y[:, cols], quantized_matmul(x, QuantizedWeight([part])))


def test_bf16_activations_and_strided_rows():
    w = QuantizedWeight([random_quantized("Q8_0", 24, 128)])
    x = torch.randn(5, 256)[:, ::2]   # strided: copied to contiguous rows first
    y32 = quantized_matmul(x, w)
    yb = quantized_matmul(x.bfloat16(), w)
    assert yb.dtype == torch.bfloat16
    check_close(yb.float(), reference(x.bfloat16().float(), w), x, w.dequantize())
    check_close(y32, reference(x, w), x, w.dequantize())


@pytest.mark.parametrize("fmt", sorted(FORMAT_IDS))
def test_embedding_rows_equal_gguf_dequantization(fmt):
    k = 256 if superblocks(fmt) else 64
    table = random_quantized(fmt, 50, k, seed=5)
    ids = torch.tensor([0, 49, 7, 7, 13])
    rows = embedding_rows(table, ids, torch.float32)
    torch.testing.assert_close(rows, table.dequantize()[ids], rtol=1e-6, atol=1e-7)
    assert embedding_rows(table, ids, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(IndexError):
        embedding_rows(table, torch.tensor([50]), torch.float32)


def _k_quant_values(fmt: str, blocks: np.ndarray, packed: bool) -> np.ndarray:
    """The unsigned quants of K-quant super-blocks [n, bytes] as [n, sub-block, value], read at the places quant.cpp
    documents for the file's order and for the kernels' (k4_repack, k6_repack)."""
    out = np.zeros((blocks.shape[0], 8, 32), np.int64)
    for b in range(8):
        for v in range(32):
            if fmt == "Q4_K":
                at, shift = (16 + 32 * (v % 16 // 4) + 4 * b + v % 4, 4 * (v // 16)) if packed else \
                    (16 + 32 * (b // 2) + v, 4 * (b % 2))
                out[:, b, v] = (blocks[:, at] >> shift) & 0xF
            else:   # Q6_K: 4 low bits and 2 high ones
                h, k = divmod(b, 4)
                lo, lo_shift = (32 * (v % 16 // 4) + 4 * b + v % 4, 4 * (v // 16)) if packed else \
                    (64 * h + 32 * (k % 2) + v, 4 * (k // 2))
                hi, hi_shift = (128 + 32 * (v // 16) + 4 * b + v % 4, 2 * (v % 16 // 4)) if packed else \
                    (128 + 32 * h + v, 2 * k)
                out[:, b, v] = ((blocks[:, lo] >> lo_shift) & 0xF) | (((blocks[:, hi] >> hi_shift) & 3) << 4)
    return out


def _kernel_high_bits(fmt: str, data: torch.Tensor) -> torch.Tensor:
    """A Q5_0 / Q5_1 row's blocks with each 32-bit high-bit word as the kernels keep it: the file's bit v (value
    v) at bit c of byte i for v = 4 c + i."""
    at, nbytes = {"Q5_0": 2, "Q5_1": 4}[fmt], KERNEL_FORMATS[FORMAT_IDS[fmt]][2]
    blocks = data.numpy().reshape(-1, nbytes).copy()
    qh = blocks[:, at:at + 4].copy().view("<u4")[:, 0].astype(np.uint64)
    word = np.zeros_like(qh)
    for c in range(8):
        for i in range(4):
            word |= ((qh >> np.uint64(4 * c + i)) & np.uint64(1)) << np.uint64(8 * i + c)
    blocks[:, at:at + 4] = word.astype("<u4").view(np.uint8).reshape(-1, 4)
    return torch.from_numpy(blocks.reshape(data.shape))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q6_K"])
def test_octet_layout_is_the_files_blocks_regrouped(fmt):
    # QuantizedWeight keeps the 32-value formats, Q4_K and Q6_K in the kernels' octet order: each row's bytes
    # regrouped (32-value formats: 11 blocks, a group of 8 and a partial one of 3), each K-quant super-block's quants
    # chunk-major (its scales in place; 2 super-blocks), dequantized and embedded as the file's blocks; a slice of
    # such a segment (restrict_vocab's head) is not regrouped twice; the kernels refuse the file's order
    k = 512 if superblocks(fmt) else 352
    raw = random_quantized(fmt, 20, k, seed=6)
    w = QuantizedWeight([raw])
    seg = w.segments[0]
    assert seg.octets and seg.kernel_type == raw.ggml_type | OCTETS and not raw.octets
    assert not torch.equal(seg.data, raw.data)
    if fmt.endswith("K"):
        nbytes = KERNEL_FORMATS[raw.ggml_type][2]
        file_blocks, packed = raw.data.numpy().reshape(-1, nbytes), seg.data.numpy().reshape(-1, nbytes)
        scales = slice(0, 16) if fmt == "Q4_K" else slice(192, 210)
        assert np.array_equal(packed[:, scales], file_blocks[:, scales])
        assert np.array_equal(_k_quant_values(fmt, packed, True), _k_quant_values(fmt, file_blocks, False))
    else:
        file_bytes = _kernel_high_bits(fmt, raw.data) if fmt.startswith("Q5") else raw.data
        assert torch.equal(seg.data.sort(dim=1).values, file_bytes.sort(dim=1).values)
    assert torch.equal(seg.dequantize(), raw.dequantize())
    ids = torch.tensor([19, 0, 5, 5])
    torch.testing.assert_close(embedding_rows(seg, ids, torch.float32), raw.dequantize()[ids], rtol=1e-6, atol=1e-7)
    head = QuantizedWeight([dataclasses.replace(seg, data=seg.data[:7])])
    assert torch.equal(head.segments[0].data, seg.data[:7])
    x = torch.randn(3, k)
    assert torch.equal(quantized_matmul(x, head), quantized_matmul(x, w)[:, :7])
    w.desc[1] = raw.ggml_type   # the same bytes declared in the file's order
    with pytest.raises(RuntimeError, match="does not know"):
        quantized_matmul(x, w)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"])
@pytest.mark.parametrize("variant", ["native", "portable"])
def test_every_size_of_a_rows_last_group(fmt, variant):
    # a row's last group of g < 8 blocks runs as a whole one with its loads masked to its g blocks (odd g: the
    # scales' last dword reaches into the next field), or, g = 1, 2, 4 on AVX2, shares an octet with the next rows'
    # last groups: rows of g blocks alone, and of a whole group and g
    with kernels.variant(variant) as lib:
        if lib is None:
            pytest.skip("no C++ kernels")
        for blocks in [*range(1, 8), *range(9, 16)]:
            k = 32 * blocks
            raw = random_quantized(fmt, 9, k, seed=blocks)
            w = QuantizedWeight([raw])
            assert torch.equal(w.dequantize(), raw.dequantize())
            x = torch.randn(3, k, generator=torch.Generator().manual_seed(blocks))
            check_close(quantized_matmul(x, w), reference(x, w), x, w.dequantize())


def test_float16_input_wrong_width_and_auto_on_the_scalar_build():
    from kvserve.model.quantization import resolve_quantization
    w = QuantizedWeight([random_quantized("Q4_0", 8, 64)])
    x = torch.randn(2, 64)
    y16 = quantized_matmul(x.half(), w)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), quantized_matmul(x.half().float(), w), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="features"):
        quantized_matmul(torch.randn(2, 96), w)
    cpu = torch.device("cpu")
    with kernels.variant("native") as lib:
        assert resolve_quantization("auto", True, cpu) == ("gguf" if lib and lib.kvserve_quant_simd() else "none")
    with kernels.variant("portable"):   # scalar kernels: slower than the dequantized model, so auto dequantizes
        assert resolve_quantization("auto", True, cpu) == "none"
        assert resolve_quantization("gguf", True, cpu) == "gguf"
    assert resolve_quantization("auto", False, cpu) == "none"


# ----- INT8: int8 per output channel, activations per token and group of int8_act_group(K) values -----

def int8_reference(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """What the INT8 kernels compute, from the packed bytes: x quantized per row and group (id = 127 / amax,
    q = round-to-even(x id), d = amax * float32(1 / 127)), exact integer sums per group, accumulated over the
    groups in order by fused multiply-adds in float32, times the row's weight scale."""
    k, ig = qt.cols, int8_act_group(qt.cols)
    groups = qt.data.reshape(-1, INT8_GROUP * int8_row_bytes(k))
    qw = groups[:, :INT8_GROUP * k].contiguous().view(torch.int8).reshape(-1, k // 4, INT8_GROUP, 4)
    qw = qw.permute(0, 2, 1, 3).reshape(-1, k // ig, ig).long()
    sw = groups[:, INT8_GROUP * k:INT8_GROUP * (k + 4)].contiguous().view(torch.float32).reshape(-1)
    xg = x.float().reshape(x.shape[0], k // ig, ig)
    amax = xg.abs().amax(-1, keepdim=True)
    qx = torch.round(xg * torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))).long()
    dx = (amax * torch.tensor(1 / 127, dtype=torch.float32))[..., 0]
    sums = torch.einsum("mgi,ngi->mng", qx, qw).float()
    acc = torch.zeros(x.shape[0], qw.shape[0])
    for g in range(k // ig):   # fma: the product is exact in float64; the float64 sum, rounded to float32, could
        acc = (sums[:, :, g].double() * dx[:, g, None].double() + acc.double()).float()   # differ at rare ties
    return (sw * acc).to(x.dtype)


@pytest.mark.parametrize("variant", ["native", "portable"])
def test_int8_is_its_integer_definition_bit_for_bit(variant):
    """Every row count (the row tiles and the GEMV alike), each activation group size (128, 64, 32), float32 and
    bf16: the same bits as the definition, so the AVX-512 VNNI, AVX2 and scalar paths agree exactly."""
    with kernels.variant(variant) as lib:
        if lib is None:
            pytest.skip("no C++ kernels")
        for k, n in ((1536, 48), (576, 32), (96, 64)):
            w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-2, 0, n)[:, None]
            qt = quantize_int8(w)
            weight = QuantizedWeight([qt])
            for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 64, 300):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                x[:, :k // 3] *= 20   # the activation groups' scales differ
                for dtype in (torch.float32, torch.bfloat16):
                    xd = x.to(dtype)
                    y = quantized_matmul(xd, weight)
                    assert y.dtype == dtype and y.shape == (rows, n)
                    assert torch.equal(y, int8_reference(xd, qt)), (k, rows, dtype)
            check_close(quantized_matmul(x, weight), reference(x, weight), x, weight.dequantize(), int8_act_group(k))


def test_int8_layout_rows_and_fallback():
    w = torch.randn(64, 192, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0   # a zero row: scale 0
    qt = quantize_int8(w)
    assert qt.format == "INT8" and qt.shape == (64, 192) and qt.data.shape == (64, int8_row_bytes(192))
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((qt.dequantize() - w).abs() <= step / 2 * 1.0001).all()   # round to nearest: half a step at most
    # each group's int32 sums of q per activation group (the VNNI path takes 128 times them back out)
    ig = int8_act_group(192)
    groups = qt.data.reshape(64 // INT8_GROUP, -1)
    q = torch.round(qt.dequantize() / torch.where(step == 0, torch.ones_like(step), step)).long()
    sums = groups[:, INT8_GROUP * (192 + 4):].contiguous().view(torch.int32).reshape(-1, 192 // ig, INT8_GROUP)
    assert torch.equal(sums.transpose(1, 2).reshape(64, -1).long(), q.reshape(64, -1, ig).sum(-1))
    weight = QuantizedWeight([qt])
    ids = torch.tensor([0, 63, 5, 17, 17])
    assert torch.equal(embedding_rows(weight.segments[0], ids, torch.float32), qt.dequantize()[ids])
    assert torch.equal(embedding_rows(weight.segments[0], ids, torch.bfloat16), qt.dequantize()[ids].bfloat16())
    # q|k|v as one weight: INT8 segments of whole groups stack into one, the same bits as each alone
    parts = [quantize_int8(w[:32]), quantize_int8(w[32:48]), quantize_int8(w[48:])]
    fused = QuantizedWeight(parts)
    assert fused.formats() == ["INT8"]
    x = torch.randn(4, 192)
    assert torch.equal(quantized_matmul(x, fused), quantized_matmul(x, weight))
    # rows that do not come in groups of 16 take Q8_0 blocks
    assert quantize_for_int8(w[:40]).format == "Q8_0" and quantize_for_int8(w[:48]).format == "INT8"
