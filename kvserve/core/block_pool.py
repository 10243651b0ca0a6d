"""BlockPool: the physical KV blocks, their reference counts, an O(1) LRU free list and the prefix-cache map.

A free block keeps its content and hash until it is handed out again, so a later request can still
hit it; get_new_blocks() takes from the head of the free list (least recently freed) and only then
drops the block's hash.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field

import numpy as np

_HASH_SEED = os.urandom(16)   # per process: block hashes are not predictable from outside


@dataclass(frozen=True)
class BlockHash:
    """A full block's chained hash plus the data it was computed from (checked on every hit)."""

    value: bytes
    token_ids: tuple[int, ...]
    extra_keys: tuple = ()


def hash_block_tokens(parent: BlockHash | None, token_ids, extra_keys: tuple = ()) -> BlockHash:
    """Chained hash of (parent hash, this block's token ids, extra keys such as LoRA name or cache salt)."""
    h = hashlib.sha256(_HASH_SEED)
    h.update(parent.value if parent is not None else b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for key in extra_keys:
        h.update(struct.pack("<Q", len(str(key))) + str(key).encode())
    return BlockHash(h.digest(), tuple(token_ids), tuple(extra_keys))


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block; `ref_cnt` counts the requests that use it."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head, append to the tail, remove from anywhere in O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free blocks")  # callers check num_free_blocks first
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head to tail (tests and debugging)."""
        ids, b = [], self._head.next_free
        while b is not self._tail:
            ids.append(b.block_id)
            b = b.next_free
        return ids


class BlockPool:
    """All KV blocks of the cache; hands them out, takes them back, remembers full blocks by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # reserve_null: block 0 is never handed out; sliding-window tables put it where a block left the window
        self.null_block = self.blocks[0] if reserve_null else None
        if self.null_block is not None:
            self.null_block.ref_cnt = 1
        self.num_usable = num_blocks - reserve_null
        self.free_queue = FreeBlockQueue(self.blocks[1:] if reserve_null else self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.on_evict = None   # called with a cached block about to be handed out again (kvserve/core/host_tier.py)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free list, evicting their cached content."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block for this hash, only if its stored tokens and keys match (no collision can hit)."""
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the cache; a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record a just-filled block under its hash (a block already cached under it wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash.value, block)

    def free_blocks(self, ordered_blocks) -> None:
        """Drop one reference from each block; blocks reaching zero join the free list tail in this order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget the block's hash without saving it anywhere (its bytes are not its tokens' KV)."""
        if block.block_hash is not None and self.cached.get(block.block_hash.value) is block:
            del self.cached[block.block_hash.value]
        block.block_hash = None

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash.value) is block:
            del self.cached[block.block_hash.value]
            if self.on_evict is not None:
                self.on_evict(block)
        block.block_hash = None
