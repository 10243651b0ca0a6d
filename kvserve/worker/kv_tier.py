"""The host tier's bytes (the data plane of kvserve/core/host_tier.py): for every KV pool of every model (target
and draft, K and V), a [slots, block bytes] buffer in host memory; the copies a step queued, performed before its
forward: saves (pool blocks into slots) first, then loads (slots into fresh pool blocks)."""
from __future__ import annotations

import torch

from kvserve.attention import attention_layers


def kv_pools(models) -> list[torch.Tensor]:
    """Every distinct KV pool of the models' attention layers, as [blocks, block bytes] uint8 views."""
    pools, seen = [], set()
    for layer in (a for m in models for a in attention_layers(m)):
        for cache in (layer.k_cache, layer.v_cache):
            if cache.data_ptr() not in seen:
                seen.add(cache.data_ptr())
                pools.append(cache.view(torch.uint8).view(cache.shape[0], -1))   # bytes: float8 pools too
    return pools


class HostTierStorage:
    """num_slots blocks of every pool in host memory. Pageable, also where the pools are on a GPU: the copies go
    through the gathered blocks (index_select), never straight from these buffers, and torch's pinned allocator would
    round each buffer up to a power of two of page-locked memory."""

    def __init__(self, pools: list[torch.Tensor], num_slots: int):
        self.pools = pools
        self.slots = [torch.empty((num_slots, p.shape[1]), dtype=torch.uint8) for p in pools]

    @staticmethod
    def bytes_per_slot(pools: list[torch.Tensor]) -> int:
        return sum(p.shape[1] for p in pools)

    def copy(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """saves: (pool block, slot); loads: (slot, pool block); in that order."""
        if saves:
            blocks, slots = torch.tensor([b for b, _ in saves]), torch.tensor([s for _, s in saves])
            for pool, tier in zip(self.pools, self.slots):
                tier.index_copy_(0, slots, pool.index_select(0, blocks.to(pool.device)).cpu())
        if loads:
            slots, blocks = torch.tensor([s for s, _ in loads]), torch.tensor([b for _, b in loads])
            for pool, tier in zip(self.pools, self.slots):
                pool.index_copy_(0, blocks.to(pool.device), tier.index_select(0, slots).to(pool.device))
