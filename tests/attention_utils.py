"""Random paged attention steps for the backend tests (test_attention_backends.py, test_triton_attention.py)."""
from __future__ import annotations

import numpy as np
import torch

from kvserve import kernels
from kvserve.attention import build_attention_metadata, kv_layout


def distinct_paths(paths: list[tuple]) -> list[tuple]:
    """The (kernel variant, ...) cases whose library differs on this CPU: a variant that drops only what the CPU
    lacks is the native library (kernels.build_of), so its case runs once, as native."""
    return list(dict.fromkeys((kernels.build_of(v), *rest) for v, *rest in paths))


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


def to_tiled(k_cache: torch.Tensor, v_cache: torch.Tensor, fill: float = 0.0):
    """Standard-layout pools rewritten in the kernel's tiled layout (every slot copied)."""
    num_blocks, bs, hkv, d = k_cache.shape
    k_shape, v_shape = kv_layout.cache_shapes(num_blocks, bs, hkv, d, tiled=True)
    kt, vt = torch.full(k_shape, fill, dtype=k_cache.dtype), torch.full(v_shape, fill, dtype=v_cache.dtype)
    kv_layout.write_slots(kt, vt, torch.arange(num_blocks * bs), k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d))
    return kt, vt


def to_standard(k_cache: torch.Tensor, v_cache: torch.Tensor):
    bs, hkv, d = kv_layout.geometry(k_cache)
    k, v = kv_layout.read_slots(k_cache, v_cache, torch.arange(k_cache.shape[0] * bs))
    return k.view(-1, bs, hkv, d), v.view(-1, bs, hkv, d)


def run(backend, batch, heads: int, upcast: bool = False, tiled: bool = False, window: int | None = None,
        softcap: float | None = None):
    """(output, K pool, V pool) of one step; tiled runs on the kernel layout and returns the pools as standard."""
    q, k, v, k_cache, v_cache, meta = batch
    if upcast:
        q, k, v, k_cache, v_cache = (x.float() for x in (q, k, v, k_cache, v_cache))
    k_cache, v_cache = to_tiled(k_cache, v_cache) if tiled else (k_cache.clone(), v_cache.clone())
    out = backend.forward(q, k, v, k_cache, v_cache, meta, heads, (q.shape[1] // heads) ** -0.5,
                          sliding_window=window, softcap=softcap)
    return (out, *to_standard(k_cache, v_cache)) if tiled else (out, k_cache, v_cache)
