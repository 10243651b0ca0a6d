"""The Triton kernels (kvserve/attention/triton/) equal the torch reference backend on random paged caches: mixed
batches of decodes, fresh prefills and chunks over cached context, GQA 1/2/3/4/8, block sizes 16/32, head dims
64/128, sliding windows, FP8 pools. On a CUDA machine they run natively in float32, bfloat16 and float16; elsewhere
under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py before triton is imported) on CPU tensors in
float32 and float16 (the interpreter emulates bfloat16 badly). The ops pass torch.library.opcheck, and a layer's
attention compiles with torch.compile(fullgraph=True)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.attention import TorchPagedAttention, build_attention_metadata, fp8  # noqa: E402
from kvserve.attention.backends import TritonPagedAttention  # noqa: E402
from kvserve.attention.triton import unavailable_reason  # noqa: E402
from attention_utils import random_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(unavailable_reason(DEVICE) is not None,
                                reason=f"Triton cannot run here: {unavailable_reason(DEVICE)}")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

SHAPES = [  # heads, kv heads, head dim, block size
    (9, 3, 64, 16),     # SmolLM2-135M: 3 query heads per KV head
    (8, 8, 64, 16),     # MHA
    (8, 2, 128, 32),    # GQA 4, D = 128, 32-token blocks
    (12, 2, 128, 16),   # Qwen2.5-1.5B: GQA 6
    (16, 2, 64, 16),    # GQA 8
    (8, 4, 64, 32),     # GQA 2
]


def on_device(batch):
    q, k, v, k_cache, v_cache, meta = batch
    if DEVICE == "cpu":
        return batch
    meta = build_attention_metadata(meta.query_lens, meta.seq_lens, meta.block_tables, meta.block_size, DEVICE)
    return (*(x.to(DEVICE) for x in (q, k, v, k_cache, v_cache)), meta)


def run_both(batch, heads: int, window: int | None = None, kv_scales=None, softcap: float | None = None):
    """(triton output, reference output, triton pools, reference pools); the reference computes in float32 on the
    same pool contents."""
    q, k, v, k_cache, v_cache, meta = batch
    d = k_cache.shape[-1]
    kc, vc = k_cache.clone(), v_cache.clone()
    out = TritonPagedAttention(DEVICE).forward(q, k, v, kc, vc, meta, heads, d ** -0.5, kv_scales, window, softcap)
    ref_kc, ref_vc = (k_cache.clone(), v_cache.clone()) if fp8.is_fp8(k_cache.dtype) else (k_cache.float(),
                                                                                           v_cache.float())
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), ref_kc, ref_vc, meta, heads, d ** -0.5,
                                        kv_scales, window, softcap)
    return out, ref, (kc, vc), (ref_kc, ref_vc)


def reference(batch, heads: int, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The torch reference's output alone, in float32."""
    q, k, v, k_cache, v_cache, meta = batch
    return TorchPagedAttention().forward(q.float(), k.float(), v.float(), k_cache.clone().float(),
                                         v_cache.clone().float(), meta,
                                         heads, k_cache.shape[-1] ** -0.5, None, window, softcap)


# every shape in float32; the other dtypes on three of them under the interpreter (each case takes seconds there)
CASES = [(s, torch.float32) for s in SHAPES] + [(s, d) for d in DTYPES[1:]
                                                for s in (SHAPES if DEVICE == "cuda" else SHAPES[:3])]


@pytest.mark.parametrize("shape, dtype", CASES, ids=lambda x: "h{}-kv{}-d{}-bs{}".format(*x) if isinstance(x, tuple)
                         else str(x))
def test_unified_attention_equals_the_reference(shape, dtype):
    heads, kv_heads, d, bs = shape
    for seed in range(2 if DEVICE == "cuda" else 1):
        batch = on_device(random_batch(seed, 6, bs, heads, kv_heads, d, dtype))
        out, ref, (kc, vc), (ref_kc, ref_vc) = run_both(batch, heads)
        torch.testing.assert_close(out.float(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        # the KV write is a copy: bit for bit
        assert torch.equal(kc, ref_kc.to(kc.dtype)) and torch.equal(vc, ref_vc.to(vc.dtype))


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_window_equals_the_reference(window):
    heads, kv_heads, d, bs = 8, 2, 64, 16
    batch = on_device(random_batch(3, 6, bs, heads, kv_heads, d, torch.float32, max_ctx=120))
    out, ref, _, _ = run_both(batch, heads, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # and the window matters: without it the outputs differ where contexts are longer than it
    assert not torch.allclose(reference(batch, heads), out, atol=1e-3)


def test_logit_softcap_with_a_window_equals_the_reference():
    """Gemma 2: scores capped at 2 * tanh(s / 2) (small, so that the cap changes them), with its window."""
    heads, kv_heads, d, bs = 8, 2, 64, 16
    batch = on_device(random_batch(12, 5, bs, heads, kv_heads, d, torch.float32, max_ctx=120))
    batch = (batch[0] * 4, *batch[1:])   # peaky scores: past the cap's linear range
    out, ref, _, _ = run_both(batch, heads, 16, softcap=2.0)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(reference(batch, heads, 16), out, atol=1e-3)


def test_one_long_prefill_over_many_blocks_and_decodes_beside_it():
    """A 300-token fresh prefill (19 blocks, several query blocks) next to decodes at odd lengths."""
    heads, kv_heads, d, bs = 4, 2, 64, 16
    lens = [300, 17, 1, 33]
    qlens = [300, 1, 1, 1]
    g = torch.Generator().manual_seed(0)
    tables, nxt = [], 0
    for s in lens:
        n = -(-s // bs)
        tables.append(list(range(nxt, nxt + n))[::-1])   # reversed: the table, not the order, places the keys
        nxt += n
    k_cache = torch.randn(nxt, bs, kv_heads, d, generator=g)
    v_cache = torch.randn(nxt, bs, kv_heads, d, generator=g)
    t = sum(qlens)
    batch = (torch.randn(t, heads * d, generator=g), torch.randn(t, kv_heads * d, generator=g),
             torch.randn(t, kv_heads * d, generator=g), k_cache, v_cache,
             build_attention_metadata(qlens, lens, tables, bs))
    out, ref, _, _ = run_both(on_device(batch), heads)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits, window, softcap", [(2, 16, None), (8, None, 2.0)])
def test_split_kv_equals_the_reference(splits, window, softcap):
    """Split KV on a mixed step (decodes, prefills, chunks: rows that see no key of some splits), with a window and
    soft-capping: each split's partial result merged by combine_splits_kernel equals the reference."""
    from kvserve.attention.triton.ops import launch_unified_attention
    heads, kv_heads, d, bs = 9, 3, 64, 16
    q, k, v, k_cache, v_cache, meta = on_device(random_batch(5, 4, bs, heads, kv_heads, d, torch.float32,
                                                             max_ctx=120))
    q = q * 2
    ref = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, heads, d ** -0.5, None, window, softcap)
    out = launch_unified_attention(q, k_cache, v_cache, meta.block_table_tensor, meta.seq_lens_tensor,
                                   meta.query_start_loc, torch.ones(2, device=q.device), heads, d ** -0.5,
                                   window or 0, softcap or 0.0, num_splits=splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_a_long_decode_splits_its_keys_by_itself():
    """One sequence decoding at 300 tokens of context (19 blocks): its step, from its shapes alone, takes 16 splits
    of up to two blocks on a GPU (10 of them with blocks; its KV heads alone would leave most of a GPU idle), 2 under
    the interpreter, and equals the reference; a batch of 64 decodes of 3 KV heads and any step with a prefill
    take none."""
    from kvserve.attention.triton.ops import decode_splits
    assert decode_splits(1, 1, 2) == 16 and decode_splits(64, 64, 3) == 1 and decode_splits(9, 2, 3) == 1
    assert decode_splits(1, 1, 2, target=4) == 2 and decode_splits(2, 2, 1, target=4) == 2
    assert decode_splits(8, 8, 2) == 16 and decode_splits(16, 16, 2) == 8 and decode_splits(32, 32, 3) == 2
    heads, kv_heads, d, bs = 12, 2, 128, 16
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = (torch.randn(20, bs, kv_heads, d, generator=g) for _ in range(2))
    batch = (torch.randn(1, heads * d, generator=g), torch.randn(1, kv_heads * d, generator=g),
             torch.randn(1, kv_heads * d, generator=g), k_cache, v_cache,
             build_attention_metadata([1], [300], [list(range(19, 0, -1))], bs))
    out, ref, _, _ = run_both(on_device(batch), heads)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def representable(dtype: torch.dtype, shape, scale: float, g: torch.Generator, saturate: bool = True) -> torch.Tensor:
    """Values whose quantization involves no rounding (fp8 values times the scale), a few past the largest: the
    interpreter's fp8 rounding is wrong where the mantissa carries into the exponent, the GPU's is not."""
    x = (torch.randn(shape, generator=g) * 40).to(dtype).float() * scale
    if saturate:
        x.view(-1)[::17] = fp8.largest(dtype) * scale * 3   # saturated to the largest
    return x


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_write_equals_the_reference_quantization(kv_dtype):
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 KV on the Triton backend needs sm_89 or newer")
    g = torch.Generator().manual_seed(1)
    scales = torch.tensor([0.5, 2.0])
    t, hkv, d = 7, 2, 64
    if DEVICE == "cpu":
        k, v = representable(kv_dtype, (t, hkv * d), 0.5, g), representable(kv_dtype, (t, hkv * d), 2.0, g)
    else:   # random values: the GPU rounds to nearest even as torch does
        k, v = torch.randn(t, hkv * d, generator=g) * 20, torch.randn(t, hkv * d, generator=g) * 300
    slots = torch.tensor([3, 17, -1, 40, 63, -5, 0])
    kc = torch.zeros(4, 16, hkv, d, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    kc, vc, k, v, slots, scales = (x.to(DEVICE) for x in (kc, vc, k, v, slots, scales))
    from kvserve.attention.triton import ops
    ops.launch_write_kv(k, v, kc, vc, slots, scales)
    keep = slots >= 0
    for cache, x, scale in ((kc, k, scales[0]), (vc, v, scales[1])):
        want = fp8.quantize(x.view(t, hkv, d)[keep], kv_dtype, scale)
        got = cache.view(-1, hkv, d)[slots[keep]]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        written = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=DEVICE)
        written[slots[keep]] = True
        assert not cache.view(-1, hkv * d)[~written].view(torch.uint8).any()   # skipped slots stay untouched


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_attention_equals_the_reference(kv_dtype):
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 KV on the Triton backend needs sm_89 or newer")
    heads, kv_heads, d, bs = 9, 3, 64, 16
    q, k, v, k_cache, v_cache, meta = random_batch(1, 6, bs, heads, kv_heads, d, torch.float32)
    k_scale, v_scale = 2.0 ** -4, 2.0 ** -5   # powers of two: x / scale is exact, so representable values stay so
    scales = torch.tensor([k_scale, v_scale])
    g = torch.Generator().manual_seed(2)
    k_cache = fp8.quantize(representable(kv_dtype, k_cache.shape, k_scale, g, False), kv_dtype, scales[0])
    v_cache = fp8.quantize(representable(kv_dtype, v_cache.shape, v_scale, g, False), kv_dtype, scales[1])
    k, v = (representable(kv_dtype, k.shape, k_scale, g, False), representable(kv_dtype, v.shape, v_scale, g, False))
    batch = on_device((q, k, v, k_cache, v_cache, meta))
    out, ref, (kc, _), (ref_kc, _) = run_both(batch, heads, kv_scales=scales.to(DEVICE))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(kc.view(torch.uint8), ref_kc.view(torch.uint8))


def test_block_sizes_the_kernel_cannot_tile_are_refused():
    from kvserve.errors import InvalidRequestError
    backend = TritonPagedAttention(DEVICE)
    for bs in (8, 24):
        with pytest.raises(InvalidRequestError, match="power of two"):
            backend.cache_shapes(4, bs, 4, 2, 64, torch.float32, DEVICE)


def test_the_ops_pass_opcheck():
    from kvserve.attention.triton import ops
    # a small step: opcheck runs each op several times
    q, k, v, k_cache, v_cache, meta = on_device(random_batch(5, 3, 16, 8, 2, 64, torch.float32, max_ctx=40))
    scales = torch.ones(2, device=DEVICE)
    torch.library.opcheck(ops.write_kv, (k, v, k_cache.clone(), v_cache.clone(), meta.slot_mapping, scales))
    torch.library.opcheck(ops.unified_attention, (q, k_cache, v_cache, meta.block_table_tensor, meta.seq_lens_tensor,
                                                  meta.query_start_loc, scales, 8, 0.125, 0, 0.0))


def test_a_layer_attention_compiles_with_fullgraph_and_no_host_sync():
    """The backend's forward traced whole (fullgraph=True: a .item(), .tolist() or data-dependent shape inside it
    would break the graph and fail here) gives the eager result."""
    heads = 8
    q, k, v, k_cache, v_cache, meta = on_device(random_batch(6, 3, 16, heads, 2, 64, torch.float32, max_ctx=40))
    backend = TritonPagedAttention(DEVICE)
    eager_kc, eager_vc = k_cache.clone(), v_cache.clone()
    eager = backend.forward(q, k, v, eager_kc, eager_vc, meta, heads, 0.125)
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v, kc, vc: backend.forward(q, k, v, kc, vc, meta, heads, 0.125),
                         fullgraph=True, backend="eager" if DEVICE == "cpu" else "inductor")
    kc, vc = k_cache.clone(), v_cache.clone()
    out = step(q, k, v, kc, vc)
    assert torch.equal(out, eager) and torch.equal(kc, eager_kc)


@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's interpreter runs only where no GPU is")
def test_the_interpreter_runs_lightened():
    """conftest.py lightened the interpreter (tests/triton_interpreter.py: no overflow sanitizer, triton.language
    patched once a launch): on a triton whose internals moved, this fails rather than the suite slowing unseen."""
    from triton.runtime import interpreter
    assert not interpreter.interpreter_builder.options.sanitize_overflow
    assert getattr(interpreter._patch_lang, "patches_once", False)
