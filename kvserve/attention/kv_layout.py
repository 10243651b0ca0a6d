"""The two layouts of a layer's K and V pools, and slot-level reads and writes that work on both.

standard: K and V are [num_blocks, block_size, num_kv_heads, head_dim]; slot s = block * block_size + offset is
    one contiguous row of num_kv_heads * head_dim elements. The torch backend, float32, FP8 and CUDA use it.
tiled: the bf16 layout of the C++ kernel (kvserve/csrc/attention_avx512.cpp). Each block holds block_size / 16 groups
    of 16 keys; per group and kv head, a K tile [head_dim / 2][16][2] (dim pair k of the 16 keys in one 64-byte
    vector) and a V tile [8][head_dim][2] (key pairs interleaved per dim): the operands vdpbf16ps takes, so the
    kernel reads them straight from the cache, in address order, without transposing or copying K/V.
    K: [num_blocks, block_size / 16, num_kv_heads, head_dim / 2, 16, 2]
    V: [num_blocks, block_size / 16, num_kv_heads, 8, head_dim, 2]
    Whole blocks keep their meaning under dim-0 copies (copy-on-write, swapping), as in the standard layout.
"""
from __future__ import annotations

import torch

TILE_KEYS = 16


def can_tile(dtype: torch.dtype, block_size: int, head_dim: int, max_head_dim: int) -> bool:
    """Whether a pool of this dtype and geometry can take the tiled layout."""
    return (dtype == torch.bfloat16 and block_size % TILE_KEYS == 0 and head_dim % 32 == 0
            and head_dim <= max_head_dim)


def cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 tiled: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(K shape, V shape) of a pool in either layout."""
    if not tiled:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape
    groups = block_size // TILE_KEYS
    return ((num_blocks, groups, num_kv_heads, head_dim // 2, TILE_KEYS, 2),
            (num_blocks, groups, num_kv_heads, TILE_KEYS // 2, head_dim, 2))


def is_tiled(cache: torch.Tensor) -> bool:
    return cache.dim() == 6


def geometry(k_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim) of a K pool in either layout."""
    if is_tiled(k_cache):
        _, groups, hkv, half_d, keys, _ = k_cache.shape
        return groups * keys, hkv, half_d * 2
    _, bs, hkv, d = k_cache.shape
    return bs, hkv, d


def _tile_index(k_cache: torch.Tensor, slots: torch.Tensor):
    """(block, 16-key group in the block, key in the group) of each slot of a tiled pool."""
    bs = k_cache.shape[1] * TILE_KEYS
    offset = slots % bs
    return slots // bs, offset // TILE_KEYS, offset % TILE_KEYS


def _key_major(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of tiled pools indexed key first: K [n, grp, hkv, d/2, key, 2] as [n, grp, key, hkv, d/2, 2], V
    [n, grp, hkv, pair, d, 2] as [n, grp, pair, 2, hkv, d]; advanced indexing on them reads or writes the pools."""
    return k_cache.permute(0, 1, 4, 2, 3, 5), v_cache.permute(0, 1, 3, 5, 2, 4)


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """Pool rows [slots[t]] = k/v [t] ([T, num_kv_heads, head_dim])."""
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    if not is_tiled(k_cache):
        hkv, d = k_cache.shape[-2:]
        if k_cache.element_size() == 1:   # torch has no index_copy_ for float8: copy the bytes
            k_cache, v_cache, k, v = (x.view(torch.uint8) for x in (k_cache, v_cache, k, v))
        k_cache.view(-1, hkv, d).index_copy_(0, slots, k)
        v_cache.view(-1, hkv, d).index_copy_(0, slots, v)
        return
    block, group, key = _tile_index(k_cache, slots)
    t, hkv, d = k.shape
    k_view, v_view = _key_major(k_cache, v_cache)
    k_view[block, group, key] = k.view(t, hkv, d // 2, 2)
    v_view[block, group, key // 2, key % 2] = v


def read_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) rows of the slots (any index shape S) as [*S, num_kv_heads, head_dim] copies."""
    if not is_tiled(k_cache):
        hkv, d = k_cache.shape[-2:]
        return k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots]
    block, group, key = _tile_index(k_cache, slots)
    _, hkv, d = geometry(k_cache)
    k_view, v_view = _key_major(k_cache, v_cache)
    return k_view[block, group, key].reshape(*slots.shape, hkv, d), v_view[block, group, key // 2, key % 2]
