"""Key segments in the C++ attention kernels (kvserve/csrc/attention.cpp, `Segments`): a step of too few work items
for the threads, or not shared evenly (one or two sequences decoding, a short chunk of a model with one kv head),
cuts its sequences' keys into runs of 1,024-key segments, work items of their own that store each segment's state,
and a second pass folds the states of the rows that span segments, in the order an unsplit work item folds them.
A row's result is the same bit for bit either way, in every kernel that splits (AVX2 and the bf16 tiles) and in
the ones that do not, and as close to the reference as before."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import kernels
from kvserve.attention import CpuPagedAttention, TorchPagedAttention, build_attention_metadata

from attention_utils import distinct_paths, run  # noqa: E402

PATHS = [  # kernel variant, dtype, tiled: the AVX2 kernel (float32 and bf16), the bf16 tiles, and the kernel over the
    # standard layout of a native build: on an AVX-512 CPU the AVX-512 one, which does not split, and must not change
    ("no-avx512", torch.float32, False), ("no-avx512", torch.bfloat16, False), ("native", torch.bfloat16, True),
    ("native", torch.float32, False)]
PATHS = distinct_paths(PATHS)
BS = 16


@pytest.fixture(autouse=True)
def two_threads():
    """The split needs fewer work items than threads, or a number they do not share evenly: one decoding sequence
    has one per kv head."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def backend(variant: str, tiled: bool) -> tuple[CpuPagedAttention, bool]:
    """The build's backend, and whether its kernel for the layout splits (the bf16 tiles, the AVX2 kernel)."""
    lib = kernels.load_variant(variant)
    if lib is None or tiled and not lib.kvserve_bf16_tiles():
        pytest.skip(f"the {variant} build has no such kernel on this CPU")
    return CpuPagedAttention(lib), tiled or (lib.kvserve_avx2() == 1 and lib.kvserve_simd() == 0)


def pools(seed: int, seq_lens: list[int], hkv: int, d: int, dtype: torch.dtype):
    """(K pool, V pool, block tables): each sequence's blocks scattered over the pools."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // BS) for s in seq_lens]
    perm = np.random.default_rng(seed).permutation(sum(need) + 2).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    k_cache, v_cache = (torch.randn(sum(need) + 2, BS, hkv, d, generator=g).to(dtype) for _ in range(2))
    return k_cache, v_cache, tables


def step(seed: int, query_lens: list[int], seq_lens: list[int], k_cache, v_cache, tables, heads: int, dtype):
    g = torch.Generator().manual_seed(seed + 100)
    t, (_, _, hkv, d) = sum(query_lens), k_cache.shape
    q, k, v = (torch.randn(t, n * d, generator=g).to(dtype) for n in (heads, hkv, hkv))
    return q, k, v, k_cache, v_cache, build_attention_metadata(query_lens, seq_lens, tables, BS)


def splits(cpu: CpuPagedAttention) -> int:
    return cpu.lib.kvserve_attention_split_steps()


@pytest.mark.parametrize("variant,dtype,tiled", PATHS)
@pytest.mark.parametrize("window", [None, 300])
def test_a_long_decode_alone_equals_its_row_in_a_step_of_many(variant, dtype, tiled, window):
    """One sequence decoding at 4,100 keys (five segments, or two under a window of 300) alone, where its segments
    are work items of their own, and as one of 40 decoding sequences, where one work item folds them."""
    cpu, splitting = backend(variant, tiled)
    rng = np.random.default_rng(3)
    seq_lens = [4100] + rng.integers(100, 900, 39).tolist()
    k_cache, v_cache, tables = pools(3, seq_lens, 3, 64, dtype)
    many = step(3, [1] * 40, seq_lens, k_cache, v_cache, tables, 9, dtype)
    alone = (*(x[:1] for x in many[:3]), k_cache, v_cache, build_attention_metadata([1], [4100], tables[:1], BS))
    before = splits(cpu)
    got, _, _ = run(cpu, alone, 9, tiled=tiled, window=window)
    assert splits(cpu) - before == int(splitting)
    assert torch.equal(got, run(cpu, many, 9, tiled=tiled, window=window)[0][:1])
    exact, _, _ = run(TorchPagedAttention(), alone, 9, upcast=True, window=window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant,dtype,tiled", PATHS)
@pytest.mark.parametrize("window", [None, 300])
def test_a_short_chunk_split_equals_it_unsplit_and_its_tokens_alone(variant, dtype, tiled, window):
    """One kv head (Gemma 3's shape): a chunk of 5 tokens over 4,095 cached ones gives 3 work items of 2 tokens, which
    split into runs of segments, each with several tokens' rows; the same chunk beside 40 decoding sequences does not
    split; each token decoded alone splits again. The same bits for every token."""
    cpu, splitting = backend(variant, tiled)
    rng = np.random.default_rng(4)
    seq_lens = [4100] + rng.integers(100, 900, 40).tolist()
    k_cache, v_cache, tables = pools(4, seq_lens, 1, 128, dtype)
    many = step(4, [5] + [1] * 40, seq_lens, k_cache, v_cache, tables, 4, dtype)
    chunk = (*(x[:5] for x in many[:3]), k_cache, v_cache, build_attention_metadata([5], [4100], tables[:1], BS))
    before = splits(cpu)
    together, k_std, v_std = run(cpu, chunk, 4, tiled=tiled, window=window)   # the pools with the chunk's keys
    assert splits(cpu) - before == int(splitting)
    assert torch.equal(together, run(cpu, many, 4, tiled=tiled, window=window)[0][:5])
    q, k, v = chunk[:3]
    for t in range(5):
        upto = 4096 + t
        alone = (q[t:t + 1], k[t:t + 1], v[t:t + 1], k_std, v_std,
                 build_attention_metadata([1], [upto], [tables[0][:-(-upto // BS)]], BS))
        assert torch.equal(run(cpu, alone, 4, tiled=tiled, window=window)[0], together[t:t + 1])
    exact, _, _ = run(TorchPagedAttention(), chunk, 4, upcast=True, window=window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.float(), exact, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant,dtype,tiled", PATHS)
def test_a_chunk_over_segments_equals_its_tokens_decoded_alone(variant, dtype, tiled):
    """A prefill chunk of 40 tokens over 2,460 cached ones (rows spanning three segments; enough work items not to
    split) and a verification of 6 tokens there, against each token decoded alone (split): the same bits for every
    token, as speculative decoding and preemption by recompute need."""
    cpu, _ = backend(variant, tiled)
    k_cache, v_cache, tables = pools(4, [2500], 3, 64, dtype)
    chunk = step(4, [40], [2500], k_cache, v_cache, tables, 9, dtype)
    together, k_std, v_std = run(cpu, chunk, 9, tiled=tiled)   # the pools with the chunk's keys written
    q, k, v = chunk[:3]
    verify = (q[-6:], k[-6:], v[-6:], k_std, v_std, build_attention_metadata([6], [2500], tables, BS))
    assert torch.equal(run(cpu, verify, 9, tiled=tiled)[0], together[-6:])
    for t in (0, 17, 34, 39):
        upto = 2461 + t
        alone = (q[t:t + 1], k[t:t + 1], v[t:t + 1], k_std, v_std,
                 build_attention_metadata([1], [upto], [tables[0][:-(-upto // BS)]], BS))
        assert torch.equal(run(cpu, alone, 9, tiled=tiled)[0], together[t:t + 1])
    exact, _, _ = run(TorchPagedAttention(), chunk, 9, upcast=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.float(), exact, atol=tol, rtol=tol)
