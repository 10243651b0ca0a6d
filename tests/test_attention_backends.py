"""The C++ CPU attention kernels equal the torch reference backend on random mixed batches (decodes, fresh
prefills, prefill chunks over cached context, scattered blocks, GQA), in float32 and bfloat16; the metadata
builder equals a plain per-sequence loop. The dense linears and fused bf16 ops: test_dense_kernels.py."""
from __future__ import annotations

import ctypes
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import kernels
from kvserve.attention import (CpuPagedAttention, TorchPagedAttention, build_attention_metadata, get_backend,
                               kv_layout)

from attention_utils import distinct_paths, random_batch, run, to_standard, to_tiled  # noqa: E402

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="no C++ compiler")


SHAPES = [  # heads, kv heads, head dim, block size
    (9, 3, 64, 16),     # SmolLM2-135M
    (4, 4, 32, 4),      # MHA, small blocks
    (8, 2, 128, 16),    # Llama-style GQA with D = 128
    (4, 1, 64, 5),      # MQA, block size not a power of two
]
TILED_SHAPES = [shape for shape in SHAPES if shape[3] % 16 == 0] + [(9, 3, 64, 64), (6, 2, 32, 32)]
needs_tiles = pytest.mark.skipif(kernels.load() is None or not kernels.load().kvserve_bf16_tiles(),
                                 reason="no C++ compiler or no AVX-512 BF16")


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_backend_equals_torch_float32(heads, kv_heads, head_dim, block_size, seed):
    batch = random_batch(seed, 7, block_size, heads, kv_heads, head_dim, torch.float32)
    ref, kc_ref, vc_ref = run(TorchPagedAttention(), batch, heads)
    got, kc, vc = run(CpuPagedAttention(), batch, heads)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_backend_bfloat16_is_as_close_to_float32_as_torch(heads, kv_heads, head_dim, block_size, seed):
    """bf16 in, bf16 out: both backends within bf16 rounding of the float32 result on the same inputs."""
    batch = random_batch(seed, 7, block_size, heads, kv_heads, head_dim, torch.bfloat16)
    exact, _, _ = run(TorchPagedAttention(), batch, heads, upcast=True)
    ref, _, _ = run(TorchPagedAttention(), batch, heads)
    got, kc, _ = run(CpuPagedAttention(), batch, heads)
    assert got.dtype == torch.bfloat16 and kc.dtype == torch.bfloat16
    err_ref = (ref.float() - exact).abs().max().item()
    err_got = (got.float() - exact).abs().max().item()
    assert err_got <= max(2 * err_ref, 1e-2)
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=1e-2)


@needs_tiles
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", TILED_SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiled_bfloat16_kernel_is_as_close_to_float32_as_torch(heads, kv_heads, head_dim, block_size, seed):
    """The kernel layout (K and V tiles vdpbf16ps takes): same bound as above, and the C++ cache write puts
    every new row where the torch write does."""
    batch = random_batch(seed, 9, block_size, heads, kv_heads, head_dim, torch.bfloat16, max_ctx=150)
    exact, _, _ = run(TorchPagedAttention(), batch, heads, upcast=True)
    ref, kc_ref, vc_ref = run(TorchPagedAttention(), batch, heads)
    got, kc, vc = run(CpuPagedAttention(), batch, heads, tiled=True)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    err_ref = (ref.float() - exact).abs().max().item()
    err_got = (got.float() - exact).abs().max().item()
    assert err_got <= max(2 * err_ref, 1e-2)
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=1e-2)


WINDOW_PATHS = [  # kernel variant, dtype, tiled: every C++ attention kernel this CPU builds
    ("native", torch.float32, False), ("native", torch.bfloat16, False), ("native", torch.bfloat16, True),
    ("no-avx512", torch.float32, False), ("no-avx512", torch.bfloat16, False), ("portable", torch.float32, False)]
WINDOW_PATHS = distinct_paths(WINDOW_PATHS)


@needs_kernels
@pytest.mark.parametrize("variant,dtype,tiled", WINDOW_PATHS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 1, 64, 5), (6, 2, 32, 32)])
def test_sliding_window_in_every_cpu_kernel_equals_torch(variant, dtype, tiled, heads, kv_heads, head_dim,
                                                         block_size):
    """Windows of 1 key, shorter than a chunk, and spanning chunks and blocks, over mixed steps whose contexts run
    far past them; the window leaves the cache write alone."""
    lib = kernels.load_variant(variant)
    if lib is None or tiled and (not lib.kvserve_bf16_tiles() or block_size % 16):
        pytest.skip(f"the {variant} build has no such kernel on this CPU")
    for seed, window in enumerate((1, 7, 45)):
        batch = random_batch(seed, 9, block_size, heads, kv_heads, head_dim, dtype, max_ctx=150)
        exact, kc_ref, vc_ref = run(TorchPagedAttention(), batch, heads, upcast=True, window=window)
        got, kc, vc = run(CpuPagedAttention(lib), batch, heads, tiled=tiled, window=window)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)
        assert torch.equal(kc.float(), kc_ref) and torch.equal(vc.float(), vc_ref)
        full, _, _ = run(TorchPagedAttention(), batch, heads, upcast=True)
        assert (full - exact).abs().max() > 10 * tol   # the window changed the result


@needs_kernels
@pytest.mark.parametrize("variant,dtype,tiled", WINDOW_PATHS)
def test_logit_softcap_in_every_cpu_kernel_equals_torch(variant, dtype, tiled):
    """Gemma 2's soft-capping (a small cap, so that it changes the scores), alone and with a window."""
    lib = kernels.load_variant(variant)
    if lib is None or tiled and not lib.kvserve_bf16_tiles():
        pytest.skip(f"the {variant} build has no such kernel on this CPU")
    for seed, window in enumerate((None, 13)):
        q, *rest = random_batch(seed, 9, 16, 9, 3, 64, dtype, max_ctx=150)
        batch = ((q.float() * 4).to(dtype), *rest)   # peaky scores: past the cap's linear range
        exact, _, _ = run(TorchPagedAttention(), batch, 9, upcast=True, window=window, softcap=2.0)
        got, _, _ = run(CpuPagedAttention(lib), batch, 9, tiled=tiled, window=window, softcap=2.0)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)
        uncapped, _, _ = run(TorchPagedAttention(), batch, 9, upcast=True, window=window)
        assert (uncapped - exact).abs().max() > 10 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_reads_and_writes_the_tiled_layout(dtype):
    """The reference backend on tiled pools gives exactly what it gives on standard ones."""
    batch = random_batch(4, 8, 32, 9, 3, 64, dtype)
    ref, kc_ref, vc_ref = run(TorchPagedAttention(), batch, 9)
    got, kc, vc = run(TorchPagedAttention(), batch, 9, tiled=True)
    assert torch.equal(got, ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@needs_tiles
def test_tiled_kernel_ignores_stale_nan_past_the_context():
    """Keys past a sequence's end share tiles (and, at odd lengths, V key pairs) with the last real ones; stale
    NaN or inf there must not leak into the output (probabilities of 0 times NaN are NaN)."""
    g = torch.Generator().manual_seed(11)
    ctx = [1, 17, 31, 33, 47]
    tables = [[0], [1, 2], [3, 4], [5, 6, 7], [8, 9, 10]]
    k_cache, v_cache = (torch.randn(11, 16, 3, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    for t, n in zip(tables, ctx):   # everything past each context: NaN, with an inf in V
        for p in range(n, 16 * len(t)):
            k_cache[t[p // 16], p % 16] = float("nan")
            v_cache[t[p // 16], p % 16] = float("inf") if p % 2 else float("nan")
    meta = build_attention_metadata([1] * 5, ctx, tables, 16)
    q, k, v = (torch.randn(5, n * 64, generator=g).to(torch.bfloat16) for n in (9, 3, 3))
    batch = (q, k, v, k_cache, v_cache, meta)
    clean = (q, k, v, k_cache.nan_to_num(0.0, 0.0, 0.0), v_cache.nan_to_num(0.0, 0.0, 0.0), meta)
    exact, _, _ = run(TorchPagedAttention(), clean, 9, upcast=True)
    got, _, _ = run(CpuPagedAttention(), batch, 9, tiled=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=1e-2)


def test_tiled_blocks_copy_whole_along_dim_0():
    """Copy-on-write and swapping copy pools along dim 0 (ModelRunner._copy_blocks): a tiled block copied there
    holds the same keys and values at the same offsets."""
    g = torch.Generator().manual_seed(3)
    k_std, v_std = (torch.randn(6, 32, 3, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    kt, vt = to_tiled(k_std, v_std)
    for cache in (kt, vt):
        cache.index_copy_(0, torch.tensor([5]), cache.index_select(0, torch.tensor([2])))
    k_back, v_back = to_standard(kt, vt)
    assert torch.equal(k_back[5], k_std[2]) and torch.equal(v_back[5], v_std[2])
    assert torch.equal(k_back[:5], k_std[:5]) and torch.equal(v_back[:5], v_std[:5])


def test_bound_bf16_pools_take_the_tiled_layout_only_where_they_can():
    from kvserve.attention import Attention, bind_kv_cache
    model = torch.nn.ModuleList([Attention(9, 64, 0.125, 3)])
    lib = kernels.load()
    tiles = lib is not None and bool(lib.kvserve_bf16_tiles())
    backend = get_backend("auto")
    (k, v), = bind_kv_cache(model, 4, 16, torch.bfloat16, backend=backend)
    assert kv_layout.is_tiled(k) == tiles and k.shape[0] == v.shape[0] == 4
    assert kv_layout.geometry(k) == (16, 3, 64)
    for dtype, bs in ((torch.float32, 16), (torch.bfloat16, 8)):
        (k, _), = bind_kv_cache(model, 4, bs, dtype, backend=backend)
        assert k.shape == (4, bs, 3, 64)
    (k, _), = bind_kv_cache(model, 4, 16, torch.bfloat16, backend=TorchPagedAttention())
    assert k.shape == (4, 16, 3, 64)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_kernel_without_simd_equals_torch(dtype):
    """The plain C++ path (other CPUs, head dims the SIMD path does not take) is tested here too."""
    lib = kernels.load_variant("portable")
    assert lib.kvserve_simd() == 0
    batch = random_batch(3, 6, 16, 9, 3, 64, dtype)
    exact, _, _ = run(TorchPagedAttention(), batch, 9, upcast=True)
    got, _, _ = run(CpuPagedAttention(lib), batch, 9)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("variant,dtype,tiled", WINDOW_PATHS)
@pytest.mark.parametrize("seed", [5, 6])
def test_long_contexts_and_large_batches_in_every_cpu_kernel(variant, dtype, tiled, seed):
    """40 sequences (decodes take their own work-item shapes in a step this big) over contexts of many chunks and
    blocks: each kernel reads the next chunk's rows ahead of the one it computes."""
    lib = kernels.load_variant(variant)
    if lib is None or tiled and not lib.kvserve_bf16_tiles():
        pytest.skip(f"the {variant} build has no such kernel on this CPU")
    batch = random_batch(seed, 40, 16, 9, 3, 64, dtype, max_ctx=700)
    exact, _, _ = run(TorchPagedAttention(), batch, 9, upcast=True)
    got, _, _ = run(CpuPagedAttention(lib), batch, 9, tiled=tiled)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)


@needs_kernels
def test_loading_the_kernels_leaves_the_process_floating_point_state_alone():
    """Linked with -ffast-math, the library would set flush-to-zero for every thread's float math, torch's too."""
    for name in ("native", "portable"):
        assert kernels.load_variant(name) is not None
    tiny = torch.tensor([1e-40])   # subnormal in float32
    assert tiny.mul(1.0).item() > 0 and 2.2250738585072014e-308 / 2 > 0


def test_the_kernel_variant_comes_from_the_environment(monkeypatch):
    """KVSERVE_KERNELS=no-avx512 runs an AVX2 machine's kernels on an AVX-512 one (a whole suite run can use it)."""
    monkeypatch.setenv("KVSERVE_KERNELS", "portable")
    assert kernels._initial_variant() == "portable"
    monkeypatch.setenv("KVSERVE_KERNELS", "")
    assert kernels._initial_variant() == "native"
    monkeypatch.setenv("KVSERVE_KERNELS", "avx1024")
    with pytest.raises(ValueError, match="KVSERVE_KERNELS='avx1024' is not a kernel variant; choose from"):
        kernels._initial_variant()


def test_auto_backend_falls_back_to_torch_without_a_compiler(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_libs", {})
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    assert isinstance(get_backend("auto"), TorchPagedAttention)
    assert not isinstance(get_backend("auto"), CpuPagedAttention)
    assert "no C++ compiler" in kernels.summary(torch.float32, torch.device("cpu"))
    assert "install g++" in caplog.text


def test_failed_build_falls_back_to_torch_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_libs", {})
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels, "_SOURCE", "this is not C++")
    assert type(get_backend("auto")) is TorchPagedAttention
    assert not kernels.status().built and "the build failed" in kernels.status().reason


@pytest.mark.parametrize("blocked", ["parent", "folder"])
def test_an_unwritable_cache_still_builds_the_kernels(monkeypatch, tmp_path, caplog, blocked):
    """A cache whose folder cannot be made, or exists and cannot be written (a read-only file system, simulated by
    making every write in it fail), builds into a temporary directory instead."""
    cache = tmp_path / "kernels"
    if blocked == "parent":
        (tmp_path / "file").write_text("a file where the cache directory should go")
        cache = tmp_path / "file" / "kernels"
    else:
        cache.mkdir()
        real_mkdtemp = tempfile.mkdtemp

        def mkdtemp(suffix=None, prefix=None, dir=None):   # the build folder: the first write into the cache
            if dir is not None and Path(dir) == cache:
                raise PermissionError(13, "Read-only file system", str(cache))
            return real_mkdtemp(suffix, prefix, dir)
        monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(kernels, "cache_dir", lambda: cache)
    # where it builds is what is tested, not the code: a one-function library builds in a fraction of a second
    path = kernels._build(kernels._compiler(), 'extern "C" int kvserve_probe() { return 7; }')
    assert ctypes.CDLL(str(path)).kvserve_probe() == 7 and "not writable" in caplog.text
    assert cache not in path.parents


def test_a_build_that_hangs_is_cut_off_with_everything_it_started(monkeypatch, tmp_path):
    """The compiler driver runs cc1plus as a child: the timeout must end both, not only the driver."""
    script = tmp_path / "slow-cxx"
    child = tmp_path / "child.pid"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && {{ echo slow 1.0; exit 0; }}\n"
                      f"sleep 30 & echo $! > {child}\nwait\n")
    script.chmod(0o755)
    monkeypatch.setattr(kernels, "_libs", {})
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(kernels, "_compiler", lambda: str(script))
    monkeypatch.setattr(kernels, "BUILD_TIMEOUT_S", 1)
    start = time.monotonic()
    assert kernels.load() is None and "did not finish within 1 s" in kernels.status().reason
    assert time.monotonic() - start < 10
    pid = int(child.read_text())
    for _ in range(50):   # the killed child is reaped by init shortly after
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the compiler's child process outlived the timeout")


def loop_metadata(query_lens, seq_lens, tables, block_size):
    """Slot mapping and per-sequence context slots, one sequence at a time."""
    slots, ctx = [], []
    for q, s, t in zip(query_lens, seq_lens, tables):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
        ctx.append([t[p // block_size] * block_size + p % block_size for p in range(s)])
    return slots, ctx


@pytest.mark.parametrize("seed", range(4))
def test_vectorized_metadata_equals_a_loop(seed):
    _, _, _, _, _, meta = random_batch(seed, 9, 4, 2, 1, 8, torch.float32)
    slots, ctx = loop_metadata(meta.query_lens, meta.seq_lens, meta.block_tables, meta.block_size)
    assert meta.slot_mapping.tolist() == slots
    starts = np.concatenate([[0], np.cumsum(meta.query_lens)])
    assert meta.query_start_loc.tolist() == starts.tolist()
    decodes = [i for i, q in enumerate(meta.query_lens) if q == 1]
    prefills = [i for i, q in enumerate(meta.query_lens) if q > 1]
    for group, seqs in zip(meta.groups, [s for s in (decodes, prefills) if s]):
        for row, i in enumerate(seqs):
            sl, ql = int(meta.seq_lens[i]), int(meta.query_lens[i])
            assert group.ctx_slots[row, :sl].tolist() == ctx[i]
            assert group.query_idx[row, :ql].tolist() == list(range(starts[i], starts[i] + ql))
            for j in range(ql):
                allowed = group.mask[row, 0, j].tolist()
                assert allowed[:sl] == [p <= sl - ql + j for p in range(sl)]


def layouts(dtype) -> tuple[bool, ...]:
    """The pool layouts the C++ kernels take for dtype: standard (False), and tiled (True) for bf16 on CPUs with
    AVX-512 BF16."""
    return (False, True) if dtype == torch.bfloat16 and kernels.load().kvserve_bf16_tiles() else (False,)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_decodes_split_by_kv_head(dtype):
    """Single-stream decode takes the one-kv-head-per-work-item path."""
    g = torch.Generator().manual_seed(7)
    k_cache = torch.randn(20, 16, 3, 64, generator=g).to(dtype)
    v_cache = torch.randn(20, 16, 3, 64, generator=g).to(dtype)
    meta = build_attention_metadata([1, 1], [70, 33], [[4, 9, 1, 17, 3], [12, 0, 5]], 16)
    q, k, v = (torch.randn(2, n * 64, generator=g).to(dtype) for n in (9, 3, 3))
    batch = (q, k, v, k_cache, v_cache, meta)
    exact, _, _ = run(TorchPagedAttention(), batch, 9, upcast=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for tiled in layouts(dtype):
        got, _, _ = run(CpuPagedAttention(), batch, 9, tiled=tiled)
        torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verification_alone_gets_its_rows_as_in_a_bigger_step(dtype):
    """One sequence with a few query tokens (a verification of 5 drafts) has fewer work items than the threads want
    when split by kv head alone: its tokens go in shorter tiles. Each row's result is the same bit for bit as in a
    step with more sequences (enough items without the split), and close to the reference."""
    g = torch.Generator().manual_seed(11)
    k_cache = torch.randn(40, 16, 3, 64, generator=g).to(dtype)
    v_cache = torch.randn(40, 16, 3, 64, generator=g).to(dtype)
    tables, seq_lens, query_lens = [[4, 9, 1, 17, 3], [12, 0, 5], [20, 21, 22, 23], [30, 31]], [70, 33, 60, 20], \
        [6, 1, 1, 1]
    q, k, v = (torch.randn(9, n * 64, generator=g).to(dtype) for n in (9, 3, 3))
    alone = (q[:6], k[:6], v[:6], k_cache, v_cache, build_attention_metadata([6], [70], tables[:1], 16))
    step = (q, k, v, k_cache, v_cache, build_attention_metadata(query_lens, seq_lens, tables, 16))
    exact, _, _ = run(TorchPagedAttention(), alone, 9, upcast=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for tiled in layouts(dtype):
        got, _, _ = run(CpuPagedAttention(), alone, 9, tiled=tiled)
        assert torch.equal(got, run(CpuPagedAttention(), step, 9, tiled=tiled)[0][:6])
        torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 5), (4, 4, 32, 4)])
@pytest.mark.parametrize("ctx", [70, 35, 6])
def test_a_tokens_row_is_the_same_in_a_decode_and_in_a_verification(dtype, heads, kv_heads, head_dim, block_size,
                                                                    ctx):
    """Speculative decoding's exactness rests on this: a token's attention output is the same bit for bit whether
    it is decoded alone (one query token) or verified among others (the last 6 tokens of the context: inside one
    chunk of 32 key positions, across a chunk boundary, or the whole context), whichever query rows share its work
    item and whichever rows the kernel pairs it with, in both layouts. In the standard layout even an inf in a later
    token's V stays out of it; the tiled kernel multiplies the V of keys past a row's end within its last chunk by
    a probability of 0, which is exact for finite values only, so there the values stay finite."""
    g = torch.Generator().manual_seed(5)
    nblocks = -(-ctx // block_size)
    k_cache = torch.randn(nblocks + 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(nblocks + 2, block_size, kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(nblocks + 2, generator=g)[:nblocks].tolist()
    q, k, v = (torch.randn(6, n * head_dim, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads))
    # the tiled layout where these shapes take it (its tiles hold 16 keys of a block)
    for tiled in layouts(dtype) if block_size % 16 == 0 else (False,):
        v_step = v.clone()
        if not tiled:
            v_step[5, 3] = float("inf")   # the last token's V: every row of the earlier tokens must not see it
        verify = (q, k, v_step, k_cache, v_cache, build_attention_metadata([6], [ctx], [table], block_size))
        together, k_std, v_std = run(CpuPagedAttention(), verify, heads, tiled=tiled)   # pools with the 6 tokens
        assert torch.isfinite(together[:5]).all()
        for t in range(6):
            upto = ctx - 5 + t
            alone = (q[t:t + 1], k[t:t + 1], v_step[t:t + 1], k_std, v_std,
                     build_attention_metadata([1], [upto], [table[:-(-upto // block_size)]], block_size))
            got = run(CpuPagedAttention(), alone, heads, tiled=tiled)[0]
            if t < 5 or tiled:
                assert torch.equal(got, together[t:t + 1])
            else:
                assert torch.equal(torch.isfinite(got), torch.isfinite(together[t:t + 1]))


def test_kernel_backend_leaves_groups_wider_than_a_work_item_to_torch():
    # 71 query heads on one kv head (Falcon-7B's shape) do not fit the kernels' 64 rows of a work item
    k_cache = torch.zeros(4, 16, 1, 64)
    assert not CpuPagedAttention.supports(torch.zeros(3, 71 * 64), k_cache)
    assert CpuPagedAttention.supports(torch.zeros(3, 64 * 64), k_cache)


@needs_kernels
def test_the_setup_command_builds_the_portable_variant_beside_the_native_one(capsys):
    # make test runs `python -m kvserve.kernels --with-portable` (both cached already, as they are here)
    assert kernels.main(["--with-portable"]) == 0
    out = capsys.readouterr().out
    assert "kvserve kernels, portable variant: built" in out and "kvserve kernels: built" in out
    assert kernels.load_variant("portable") is not None
    assert kernels.main(["--portable"]) == 2


@needs_kernels
def test_a_variant_dropping_what_this_cpu_lacks_is_the_native_library():
    # no-avx512 on an AVX2 CPU would compile what native compiles: tests ask for it, and must not build it again
    for name in ("no-avx512", "no-avx512bf16"):
        same = kernels.load_variant(name) is kernels.load_variant("native")
        assert same == (not kernels.differs_here(name)), name
