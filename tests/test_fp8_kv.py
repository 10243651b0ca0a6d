"""FP8 KV cache (kv_cache_dtype="fp8" | "fp8_e4m3" | "fp8_e5m2"): the C++ pool writes are bit-identical to torch's
conversion, the C++ attention over FP8 pools matches the torch backend, the engine holds 4x float32's tokens
(2x bf16's) in the same memory (perplexity within 2% of the unquantized cache: test_perplexity.py), scheduling
changes nothing, calibrated scales, and bad values."""
import subprocess
import sys

import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.attention import TorchPagedAttention, attention_layers, build_attention_metadata, fp8
from kvserve.attention.backends import CpuPagedAttention
from kvserve.config import EngineConfig
from kvserve.errors import InvalidRequestError

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="no C++ kernels")
# the builds whose FP8 paths differ here: no-avx512 on a CPU without AVX-512 is the native library
VARIANTS = kernels.distinct_builds(("native", "no-avx512", "portable"))


def _write_both(dtype, k, v, scales, block_size=16, num_blocks=8):
    """The pools after writing k, v [T, Hkv*D] into slots 0.. through the torch backend and the C++ kernel."""
    hkv, d = 2, k.shape[1] // 2
    meta = build_attention_metadata([k.shape[0]], [k.shape[0]], [list(range(num_blocks))], block_size=block_size)
    out = []
    for backend in (TorchPagedAttention(), CpuPagedAttention()):
        kc = torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        if isinstance(backend, CpuPagedAttention):
            kernels.write_kv(backend.lib, k, v, kc, vc, meta.kernel_args, scales)
        else:
            backend.write_kv(kc, vc, k, v, meta, scales)
        out.append((kc.view(torch.uint8), vc.view(torch.uint8)))
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", FORMATS)
def test_every_code_and_every_midpoint_rounds_as_torch(dtype):
    """Each finite code's value, the midpoints between neighbours (ties to even), values past the largest
    (saturated), infinities, NaN, signed zeros and values under the smallest subnormal."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = codes[torch.isfinite(codes)].unique()
    mids = (values[1:] + values[:-1]) / 2
    extra = torch.tensor([0.0, -0.0, 1e30, -1e30, fp8.largest(dtype) * 1.02, 1e-30, -1e-12, float("inf"),
                          -float("inf"), float("nan")])
    x = torch.cat([values, mids, mids.nextafter(torch.tensor(float("inf"))), extra])
    x = torch.cat([x, x.new_zeros(-x.numel() % 64)]).reshape(-1, 64)
    (tk, tv), (ck, cv) = _write_both(dtype, x, -x, torch.ones(2), num_blocks=-(-x.shape[0] // 16))
    assert torch.equal(tk, ck) and torch.equal(tv, cv)


@needs_kernels
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_kernel_pool_writes_are_bit_identical_to_torch(dtype, x_dtype):
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(100, 64, generator=gen) * torch.logspace(-5, 4, 100)[:, None]).to(x_dtype)
    v = (torch.randn(100, 64, generator=gen) * 0.01).to(x_dtype)
    (tk, tv), (ck, cv) = _write_both(dtype, k, v, torch.tensor([0.37, 0.0021]))
    assert torch.equal(tk, ck) and torch.equal(tv, cv)


@needs_kernels
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_kernel_attention_over_fp8_pools_matches_the_torch_backend(dtype, q_dtype):
    """Two sequences, a chunk of a prefill over cached context and a decode, GQA, scattered blocks: the kernel
    (K's scale folded into the queries, V's into the output) against torch (dequantized pools, SDPA); and both
    close to attention over a pool in the queries' dtype."""
    gen = torch.Generator().manual_seed(1)
    h, hkv, d, bs = 6, 2, 32, 16
    ctx = [40, 23]
    tables = [[5, 0, 7], [2, 6]]
    k, v = torch.randn(sum(ctx), hkv * d, generator=gen), torch.randn(sum(ctx), hkv * d, generator=gen) * 0.1
    q = torch.randn(sum(ctx), h * d, generator=gen)
    scales = torch.tensor([4.0 / 224, 0.4 / 224])
    # prefill both, then a step of A's last 9 tokens (a chunk over 31 cached ones) and B's last (a decode)
    first = build_attention_metadata([31, 22], [31, 22], tables, block_size=bs)
    second = build_attention_metadata([9, 1], ctx, tables, block_size=bs)
    rows1 = list(range(31)) + list(range(40, 62))
    rows2 = list(range(31, 40)) + [62]
    outs = []
    for backend, pool_dtype in ((TorchPagedAttention(), dtype), (CpuPagedAttention(), dtype),
                                (TorchPagedAttention(), q_dtype)):
        kc = torch.zeros(8, bs, hkv, d, dtype=pool_dtype)
        vc = torch.zeros_like(kc)
        for rows, meta in ((rows1, first), (rows2, second)):
            out = backend.forward(q[rows].to(q_dtype), k[rows].to(q_dtype), v[rows].to(q_dtype), kc, vc, meta, h,
                                  d ** -0.5, scales)
        outs.append(out.float())
    ref_fp8, kernel, unquantized = outs
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel, ref_fp8, atol=tol, rtol=tol)
    err = (kernel - unquantized).abs().max() / unquantized.abs().max()
    assert err < (0.06 if dtype == torch.float8_e4m3fn else 0.12), err


# a shared first block (16+ tokens): prompts after the first hit the prefix cache
PREFIX = "Answer in one short sentence, plainly, without any preamble or apology, and then stop. "
PROMPTS = [PREFIX + p for p in ["The capital of France is", "def fibonacci(n):",
                                "Once upon a time, in a land far away,", "List three prime numbers:",
                                "The GNU General Public License is"]]
STEP = 48   # small steps: the batch's prefills are chunked


def generate(llm, prompts, n=16):
    return llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0), use_tqdm=False)


def greedy(llm, prompts, n=16):
    return [o.outputs[0].token_ids for o in generate(llm, prompts, n)]


@pytest.fixture(scope="module")
def fp8_llm():
    return LLM(dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="24MiB", max_num_batched_tokens=STEP)


@pytest.fixture(scope="module")
def base_llm():
    # dense weights: the bundled GGUF kept quantized multiplies int8-quantized activations, whose rounding turns
    # any change in the attention's last bits into a perplexity change of a few tenths of a percent either way
    return LLM(dtype="float32", kv_cache_memory="24MiB", max_num_batched_tokens=STEP, quantization="none")


def test_fp8_pools_hold_four_times_float32_tokens_in_the_same_memory(fp8_llm, base_llm):
    engine, base = fp8_llm.llm_engine, base_llm.llm_engine
    pools = [(a.k_cache, a.v_cache) for a in attention_layers(engine.model)]
    assert all(k.dtype == v.dtype == torch.float8_e4m3fn for k, v in pools)
    assert engine.num_kv_blocks == 4 * base.num_kv_blocks   # 1 byte a value against 4 (2x against bf16's 2)
    assert engine.kv_cache_description() == " in fp8_e4m3 (scales 1.0)" and base.kv_cache_description() == ""


def test_scheduling_changes_nothing_on_fp8_pools(fp8_llm):
    """Each value is quantized alone (per-layer scales, no per-batch statistics): batching, chunked prefill,
    prefix-cache hits and preemption give the same tokens as each prompt alone."""
    runs = [generate(fp8_llm, [p])[0] for p in PROMPTS]
    alone = [o.outputs[0].token_ids for o in runs]
    assert all(o.num_cached_tokens >= 16 for o in runs[1:])   # the shared first block came from the cache
    assert greedy(fp8_llm, PROMPTS) == alone   # one batch, prefills chunked, from the cache again
    # n = 2 samples share their prompt's blocks: the partly filled last one is copied on write
    pairs = fp8_llm.generate(PROMPTS[:3], SamplingParams(n=2, max_tokens=16, temperature=0), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in pairs] == [[a, a] for a in alone[:3]]
    tight = LLM(dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=6, max_num_batched_tokens=16,
                enable_prefix_caching=False)
    spec = LLM(dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="24MiB", max_num_batched_tokens=STEP,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    assert greedy(tight, PROMPTS) == alone
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert greedy(spec, PROMPTS) == alone   # k + 1 query tokens a step read the pools as decodes do


def test_calculated_scales_come_from_the_first_step():
    llm = LLM(dtype="float32", kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True, kv_cache_memory="24MiB")
    layer = attention_layers(llm.llm_engine.model)[3]
    seen = []

    class Spy:   # the layer's backend, recording the K/V it is given (kvserve modules take no hooks)
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def forward(self, q, k, v, *args, **kwargs):
            seen.append((k.clone(), v.clone()))
            return self.inner.forward(q, k, v, *args, **kwargs)

    layer.backend = Spy(layer.backend)
    greedy(llm, PROMPTS[:2], n=4)
    k, v = seen[0]
    half = fp8.largest(torch.float8_e5m2) / fp8.CALIBRATION_HEADROOM
    assert torch.equal(layer.kv_scales, torch.stack([k.abs().max(), v.abs().max()]).float() / half)
    assert not layer.calibrate_kv_scales and llm.llm_engine.kv_cache_description().endswith(
        "(scales calibrated on the first step)")
    before = layer.kv_scales.clone()
    greedy(llm, PROMPTS[2:4], n=4)
    assert torch.equal(layer.kv_scales, before)   # set once


def test_bad_kv_cache_dtypes_are_refused():
    for bad in ("fp4", "int8", "float8"):
        with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, fp8") as e:
            EngineConfig(kv_cache_dtype=bad)
        assert e.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidRequestError, match="calculate_kv_scales sets the scales of an FP8 KV cache") as e:
        EngineConfig(calculate_kv_scales=True)
    assert e.value.param == "calculate_kv_scales"
    proc = subprocess.run([sys.executable, "-m", "kvserve", "generate", "--kv-cache-dtype", "fp16", "hi"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'fp16'" in proc.stderr


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("d", [64, 48])
def test_every_finite_code_reads_as_torch_in_every_kernel_variant(variant, dtype, d):
    """Pools holding every finite code of the format (denormals, both signs, the largest) in K and in V, read by
    each kernel variant this CPU builds (the AVX-512 kernel widens FP8 on 16 lanes where head dims are a multiple
    of 32, the AVX2 one with F16C, the portable one looks codes up): float32 attention over them equals torch's
    over its own conversion of the pools, within float32 rounding."""
    lib = kernels.load_variant(variant)
    if lib is None:
        pytest.skip(f"the {variant} build does not run on this CPU")
    gen = torch.Generator().manual_seed(3)
    h, hkv, bs, ctx = 2, 1, 16, 64
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = torch.arange(256, dtype=torch.uint8)[torch.isfinite(codes.float())]
    n = ctx * hkv * d
    pools = [finite[torch.randperm(len(finite), generator=gen)].repeat(n // len(finite) + 1)[:n] for _ in range(2)]
    kc, vc = (p.view(dtype).view(ctx // bs, bs, hkv, d).clone() for p in pools)
    largest = codes.float()[torch.isfinite(codes.float())].abs().max()
    scales = torch.tensor([1.0 / largest, 1.0 / largest])
    # a chunk of 8 tokens and, on the same blocks, the decode after it: they write the last 9 slots
    meta = build_attention_metadata([8, 1], [ctx - 1, ctx], [list(range(ctx // bs))] * 2, block_size=bs)
    q = torch.randn(9, h * d, generator=gen)
    k, v = (torch.randn(9, hkv * d, generator=gen) * largest for _ in range(2))
    got = CpuPagedAttention(lib).forward(q, k, v, kc.clone(), vc.clone(), meta, h, d ** -0.5, scales)
    want = TorchPagedAttention().forward(q, k, v, kc.clone(), vc.clone(), meta, h, d ** -0.5, scales)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", FORMATS)
def test_a_nan_written_to_the_pool_reaches_exactly_the_rows_that_see_it(variant, dtype):
    """A NaN value is stored as the format's NaN code and every kernel variant reads it as NaN (E4M3's one NaN code
    would otherwise read as 480): the rows of a chunk from the NaN's token on are NaN, the rows before it finite."""
    lib = kernels.load_variant(variant)
    if lib is None:
        pytest.skip(f"the {variant} build does not run on this CPU")
    gen = torch.Generator().manual_seed(4)
    h, hkv, d, bs, n = 3, 1, 64, 16, 9
    meta = build_attention_metadata([n], [40], [[1, 0, 2]], block_size=bs)
    q, k, v = (torch.randn(n, x * d, generator=gen) for x in (h, hkv, hkv))
    v[4, 7] = float("nan")
    kc = torch.randn(3, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(3, bs, hkv, d, generator=gen).to(dtype)
    scales = torch.tensor([0.5, 0.25])
    got = CpuPagedAttention(lib).forward(q, k, v, kc.clone(), vc.clone(), meta, h, d ** -0.5, scales)
    want = TorchPagedAttention().forward(q, k, v, kc.clone(), vc.clone(), meta, h, d ** -0.5, scales)
    assert got.isnan().any(dim=1).tolist() == [False] * 4 + [True] * 5
    torch.testing.assert_close(got[4:], want[4:], atol=1e-5, rtol=1e-5, equal_nan=True)
    # torch's masked product (probability 0 times NaN) spreads the NaN to the rows before it: those rows against
    # the step without the NaN
    v[4, 7] = 0.0
    clean = TorchPagedAttention().forward(q, k, v, kc.clone(), vc.clone(), meta, h, d ** -0.5, scales)
    torch.testing.assert_close(got[:4], clean[:4], atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_pools_take_the_widest_kernel_the_build_has(variant):
    """The kernel the dispatch picks for FP8 pools (the same function paged_attention calls): the AVX-512 one where
    head dims are a multiple of 32 and a row fits, else the AVX2 one (head dims a multiple of 16), else portable."""
    lib = kernels.load_variant(variant)
    if lib is None:
        pytest.skip(f"the {variant} build does not run on this CPU")
    simd, avx2 = lib.kvserve_simd(), lib.kvserve_avx2()
    for fmt in fp8.FORMATS.values():   # the codes the kernels take: E4M3, E5M2
        widest = 512 if simd else 2 if avx2 else 0
        assert lib.kvserve_fp8_attention_path(9, 3, 64, fmt) == widest
        assert lib.kvserve_fp8_attention_path(6, 2, 32, fmt) == widest   # the shapes of the tests above
        assert lib.kvserve_fp8_attention_path(2, 1, 48, fmt) == (2 if avx2 else 0)
        assert lib.kvserve_fp8_attention_path(2, 1, 40, fmt) == 0
        assert lib.kvserve_fp8_attention_path(80, 8, 64, fmt) == (2 if avx2 else 0)   # more rows than an item holds


@needs_kernels
def test_the_kernels_line_names_the_fp8_attention_kernel():
    line = kernels.summary(torch.bfloat16, torch.device("cpu"), torch.float8_e4m3fn)
    st = kernels.status()
    assert ("FP8 KV (AVX-512 kernel" if st.avx512 else "FP8 KV (AVX2 kernel, F16C" if st.fp8_avx2
            else "FP8 KV (portable kernel)") in line
    assert st.fp8_avx2 == st.avx2   # F16C comes with AVX2
