"""Random paged attention steps for the backend tests (test_attention_backends.py, test_triton_attention.py)."""
from __future__ import annotations

import numpy as np
import torch

from kvserve.attention import build_attention_metadata


def random_batch(seed: int, num_seqs: int, block_size: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, max_ctx: int = 90):
    """A step mixing decodes, fresh prefills and chunks over cached context, with shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    query_lens, seq_lens = [], []
    for _ in range(num_seqs):
        kind = rng.integers(3)
        ctx = int(rng.integers(1, max_ctx))
        q = 1 if kind == 0 else ctx if kind == 1 else int(rng.integers(1, ctx + 1))
        query_lens.append(q)
        seq_lens.append(ctx)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    perm = rng.permutation(num_blocks).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    t = sum(query_lens)
    q = torch.randn(t, heads * head_dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads * head_dim, generator=g).to(dtype)
    v = torch.randn(t, kv_heads * head_dim, generator=g).to(dtype)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    return q, k, v, k_cache, v_cache, meta
