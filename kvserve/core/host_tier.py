"""HostTier: a second tier of the prefix cache, in host memory (the control plane; the model runner holds the
blocks' bytes and performs the copies: kvserve/worker/kv_tier.py).

A full block the pool evicts (a cached block handed out again) is saved here under its hash instead of being
lost; a prefix lookup that misses the pool finds it here, and the block is loaded back into a fresh pool block
instead of recomputed. A preempted request's blocks take the same way (preemption by swap: its blocks stay cached
when it is freed, are saved as the pool hands them out, and are found again when it resumes). The tier is an LRU
of slots; one full evicts its least recently used entry, so a lookup can only miss, never fail.

The copies of a step are queued here and taken by the runner before the step's forward: saves first (they read
pool blocks about to be overwritten), then loads (they write fresh pool blocks); a slot a load reads is pinned
until then, so no save of the same step overwrites it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.core.block_pool import BlockHash


@dataclass(frozen=True)
class TierHit:
    """A prefix-cache hit in the host tier: the slot holding the block with this hash."""
    slot: int
    block_hash: BlockHash


class HostTier:
    """num_slots blocks of host memory indexed by block hash, least recently used first out."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.entries: OrderedDict[bytes, tuple[int, BlockHash]] = OrderedDict()
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()
        # slot -> the pool block to save into it (a slot reused within a step keeps only its last save), and
        # (slot, pool block) loads
        self.saves: dict[int, int] = {}
        self.loads: list[tuple[int, int]] = []
        self.num_saved = self.num_loaded = self.num_evicted = 0

    def lookup(self, block_hash: BlockHash) -> TierHit | None:
        """The slot holding this block (its tokens and keys checked, as the pool's map does), or None."""
        entry = self.entries.get(block_hash.value)
        if entry is None or entry[1] != block_hash:
            return None
        self.entries.move_to_end(block_hash.value)
        return TierHit(entry[0], block_hash)

    def save(self, block_hash: BlockHash, block_id: int) -> None:
        """Queue pool block `block_id` (about to be handed out again) to be kept under its hash."""
        if block_hash.value in self.entries:
            self.entries.move_to_end(block_hash.value)   # already kept: the same tokens, the same bytes
            return
        slot = self._free_slot()
        if slot is None:
            return   # every slot is being loaded this step: this block is lost, as without a tier
        self.entries[block_hash.value] = (slot, block_hash)
        self.saves[slot] = block_id
        self.num_saved += 1

    def pin(self, slots) -> None:
        """Keep these slots (hits about to be loaded) from being reused by this step's saves."""
        self.pinned.update(slots)

    def load(self, hit: TierHit, block_id: int) -> None:
        """Queue the hit's slot to be copied into pool block `block_id` before the next forward."""
        self.loads.append((hit.slot, block_id))
        self.pinned.add(hit.slot)
        self.num_loaded += 1

    def drop_loads_into(self, block_ids: set[int]) -> list[int]:
        """Cancel the queued loads into blocks freed before the step ran (a request that failed or left); returns
        the blocks whose loads were cancelled."""
        dropped = [block for _, block in self.loads if block in block_ids]
        self.loads = [(slot, block) for slot, block in self.loads if block not in block_ids]
        return dropped

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(saves as (pool block, slot), loads as (slot, pool block)) queued since the last call: each slot saved
        into at most once, each block loaded into at most once; the runner performs the saves first."""
        saves, loads = [(block, slot) for slot, block in self.saves.items()], self.loads
        self.saves, self.loads = {}, []
        self.pinned.clear()
        return saves, loads

    def reset(self) -> None:
        """Forget every entry and queued save (reset_prefix_cache: no block is in use, so none is being loaded)."""
        self.entries.clear()
        self.saves.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for value, (slot, _) in self.entries.items():   # least recently used first
            if slot not in self.pinned:
                del self.entries[value]
                self.num_evicted += 1
                return slot
        return None
