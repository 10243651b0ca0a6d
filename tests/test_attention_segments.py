"""Key segments in the C++ attention kernels (kvserve/csrc/attention.cpp, `Segments`): a step of too few work items
for the threads (one or two sequences decoding over long contexts) takes each 256-key segment of a sequence as a
work item of its own, and a second pass folds the states of the rows that span segments, in the order an unsplit
work item folds them. A row's result is the same bit for bit either way, in every kernel that splits (AVX2 and
the bf16 tiles) and in the ones that do not, and as close to the reference as before."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import kernels
from kvserve.attention import CpuPagedAttention, TorchPagedAttention, build_attention_metadata

from attention_utils import run  # noqa: E402

PATHS = [  # kernel variant, dtype, tiled: the AVX2 kernel (float32 and bf16), the bf16 tiles; the AVX-512 kernel
    # over the standard layout does not split, and must not change either
    ("no-avx512", torch.float32, False), ("no-avx512", torch.bfloat16, False), ("native", torch.bfloat16, True),
    ("native", torch.float32, False)]
H, HKV, D, BS = 9, 3, 64, 16


@pytest.fixture(autouse=True)
def two_threads():
    """The split needs fewer work items than twice the threads: one decoding sequence has 3 (one per kv head)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def backend(variant: str, tiled: bool) -> CpuPagedAttention:
    lib = kernels.load_variant(variant)
    if lib is None or tiled and not lib.kvserve_bf16_tiles():
        pytest.skip(f"the {variant} build has no such kernel on this CPU")
    return CpuPagedAttention(lib)


def pools(seed: int, seq_lens: list[int], dtype: torch.dtype):
    """(K pool, V pool, block tables): each sequence's blocks scattered over the pools."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // BS) for s in seq_lens]
    perm = np.random.default_rng(seed).permutation(sum(need) + 2).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    k_cache, v_cache = (torch.randn(sum(need) + 2, BS, HKV, D, generator=g).to(dtype) for _ in range(2))
    return k_cache, v_cache, tables


def step(seed: int, query_lens: list[int], seq_lens: list[int], k_cache, v_cache, tables, dtype):
    g = torch.Generator().manual_seed(seed + 100)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n * D, generator=g).to(dtype) for n in (H, HKV, HKV))
    return q, k, v, k_cache, v_cache, build_attention_metadata(query_lens, seq_lens, tables, BS)


@pytest.mark.parametrize("variant,dtype,tiled", PATHS)
@pytest.mark.parametrize("window", [None, 300])
def test_a_long_decode_alone_equals_its_row_in_a_step_of_many(variant, dtype, tiled, window):
    """One sequence decoding at 1,000 keys (four segments, or two under a window of 300) alone, where its segments
    are work items of their own, and as one of 40 decoding sequences, where one work item folds them."""
    cpu = backend(variant, tiled)
    rng = np.random.default_rng(3)
    seq_lens = [1000] + rng.integers(100, 900, 39).tolist()
    k_cache, v_cache, tables = pools(3, seq_lens, dtype)
    many = step(3, [1] * 40, seq_lens, k_cache, v_cache, tables, dtype)
    alone = (*(x[:1] for x in many[:3]), k_cache, v_cache, build_attention_metadata([1], [1000], tables[:1], BS))
    got, _, _ = run(cpu, alone, H, tiled=tiled, window=window)
    assert torch.equal(got, run(cpu, many, H, tiled=tiled, window=window)[0][:1])
    exact, _, _ = run(TorchPagedAttention(), alone, H, upcast=True, window=window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant,dtype,tiled", PATHS)
def test_a_chunk_over_segments_equals_its_tokens_decoded_alone(variant, dtype, tiled):
    """A prefill chunk of 40 tokens over 660 cached ones (rows spanning three segments, enough work items not to
    split) and a verification of 6 tokens there (few items: split), against each token decoded alone (split):
    the same bits for every token, as speculative decoding and preemption by recompute need."""
    cpu = backend(variant, tiled)
    k_cache, v_cache, tables = pools(4, [700], dtype)
    chunk = step(4, [40], [700], k_cache, v_cache, tables, dtype)
    together, k_std, v_std = run(cpu, chunk, H, tiled=tiled)   # the pools with the chunk's keys written
    q, k, v = chunk[:3]
    verify = (q[-6:], k[-6:], v[-6:], k_std, v_std, build_attention_metadata([6], [700], tables, BS))
    assert torch.equal(run(cpu, verify, H, tiled=tiled)[0], together[-6:])
    for t in (0, 17, 34, 39):
        upto = 661 + t
        alone = (q[t:t + 1], k[t:t + 1], v[t:t + 1], k_std, v_std,
                 build_attention_metadata([1], [upto], [tables[0][:-(-upto // BS)]], BS))
        assert torch.equal(run(cpu, alone, H, tiled=tiled)[0], together[t:t + 1])
    exact, _, _ = run(TorchPagedAttention(), chunk, H, upcast=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.float(), exact, atol=tol, rtol=tol)
