"""KVCacheManager: each request's block tables, slot allocation and prefix-cache lookups.

    request tokens:  | block 0 | block 1 | block 2 | blk 3 (partial) |
    cached (hit):    |<---- get_computed_blocks ---->|
    computed:        |<---------- num_computed_tokens ------->|
    allocate_slots:  makes room for the next num_new_tokens, taking new blocks only when the tail is full

A request has one block table per KV group (kvserve/core/kv_groups.py; one group unless the model has sliding-
window layers). A sliding-window group's table puts the null block where a block has left the window of every
query to come, and gives the block back to the pool (still cached under its hash, like any freed block).

Forked requests (the n samples of one prompt) share blocks; the first write into a block that another
request still holds copies it first (copy-on-write): allocate_slots swaps in a fresh block and queues
a (src, dst) copy that the model runner performs before the forward pass.
"""
from __future__ import annotations

import hashlib

from kvserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from kvserve.core.host_tier import HostTier, TierHit
from kvserve.core.kv_groups import KVGroups, cdiv
from kvserve.core.request import Request
from kvserve.kv_transfer.keys import ConnectorHit

__all__ = ["KVCacheManager", "cdiv"]


class KVCacheManager:
    """Owns the BlockPool; maps request ids to their blocks (req_to_blocks: the first group's table; extra_tables:
    the other groups')."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, groups: KVGroups | None = None,
                 tier: HostTier | None = None, connector=None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = groups or KVGroups.single(1)
        self.windows = self.groups.windows
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null=self.groups.has_windows)
        self.null = self.pool.null_block
        self.flat = not self.groups.has_windows   # one group, every block kept: hits are one list
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.extra_tables: dict[str, list[list[KVCacheBlock]]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # leading blocks of the request already in the cache map
        self.pending_copies: list[tuple[int, int]] = []   # copy-on-write (src, dst) block ids for the next forward
        # the prefix cache's second tier in host memory (host_tier.py): blocks the pool evicts are kept there
        self.tier = tier
        if tier is not None:
            if not (enable_caching and self.flat):
                raise ValueError("a host tier needs prefix caching and one KV group")
            self.pool.on_evict = lambda block: tier.save(block.block_hash, block.block_id)
        # a KV connector (kvserve/kv_transfer): a consumer's lookups go on in its store where the pool and the tier
        # miss; its hits are loaded, like the tier's, into fresh blocks before the next forward
        self.connector = connector
        self.connector_loads: list[tuple[ConnectorHit, int]] = []
        if connector is not None and not (enable_caching and self.flat):
            raise ValueError("a KV connector needs prefix caching and one KV group")

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (the null block of sliding-window tables is not one)."""
        return self.pool.num_usable

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int, chunk: int) -> int:
        """Blocks one sequence of num_tokens tokens holds at most, computed in steps of up to `chunk` tokens."""
        return self.groups.blocks_needed(num_tokens, chunk, self.block_size)

    def _tables(self, request_id: str) -> list[list[KVCacheBlock]]:
        if request_id not in self.req_to_blocks:
            return []
        return [self.req_to_blocks[request_id], *self.extra_tables.get(request_id, ())]

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        tables = self._tables(request_id)
        return [b.block_id for b in tables[group]] if tables else []

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Every group's table of the request (one list per group)."""
        return [self.get_block_ids(request_id, g) for g in range(len(self.windows))]

    def _held(self, blocks) -> list[KVCacheBlock]:
        return [b for b in blocks if b is not self.null]

    def _group_hash(self, block_hash: BlockHash, group: int) -> BlockHash:
        """The cache key of a block of `group` (group 0: the block's own hash)."""
        if group == 0:
            return block_hash
        value = hashlib.sha256(block_hash.value + b"kv group" + group.to_bytes(4, "little")).digest()
        return BlockHash(value, block_hash.token_ids, (*block_hash.extra_keys, ("kv group", group)))

    def get_computed_blocks(self, req: Request) -> tuple[list, int]:
        """Longest run of cached full blocks for this request's tokens, and how many tokens they hold. With several
        groups the hits are one list per group: full-attention groups need every block of the run, a sliding
        group only those the window of the first token after it reaches (null before them)."""
        if (not self.enable_caching or req.params.prompt_logprobs is not None
                or (req.pooling is not None and req.pooling.needs_every_position)):
            return [], 0   # prompt logprobs, and pooling over every position, need every prompt position computed
        self._update_block_hashes(req, req.num_tokens)
        # the last token is always recomputed so there are logits to sample from
        hashes = req.block_hashes[:(req.num_tokens - 1) // self.block_size]
        if self.flat:
            hits = []
            for i, block_hash in enumerate(hashes):   # in the pool, else the host tier, else the connector's store
                block = self.pool.get_cached_block(block_hash)
                if block is None and self.tier is not None:
                    block = self.tier.lookup(block_hash)
                if block is None:
                    if self.connector is not None:   # loaded back, as the tier's hits, by allocate_slots
                        hits += self.connector.lookup(hashes, i)
                    break
                hits.append(block)
            return hits, len(hits) * self.block_size
        return self._group_hits(hashes)

    def _group_hits(self, hashes: list[BlockHash]) -> tuple[list[list[KVCacheBlock]], int]:
        def cached(g: int, i: int) -> KVCacheBlock | None:
            return self.pool.get_cached_block(self._group_hash(hashes[i], g))
        full = [g for g, w in enumerate(self.windows) if w is None]
        n = 0
        while n < len(hashes) and all(cached(g, n) for g in full):
            n += 1
        for n in range(n, -1, -1):   # the longest run whose last windows are cached too
            firsts = [self._first_needed(g, n * self.block_size) for g in range(len(self.windows))]
            if all(cached(g, i) for g, first in enumerate(firsts) if self.windows[g] is not None
                   for i in range(first, n)):
                break
        hits = [[self.null] * first + [cached(g, i) for i in range(first, n)] for g, first in enumerate(firsts)]
        return hits, n * self.block_size

    def _first_needed(self, group: int, position: int) -> int:
        """The first block a query at `position` (or later) reads in `group`."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks=()) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens; None when the pool cannot (preempt or wait).
        new_computed_blocks: get_computed_blocks' hits (with several groups, one list per group)."""
        if self.flat and not new_computed_blocks and self._fits(req, num_new_tokens):
            return []   # most decode steps: what the general plan below comes to when nothing changes
        rid = req.request_id
        fresh = rid not in self.req_to_blocks
        if fresh:
            self.req_to_blocks[rid] = []
            if len(self.windows) > 1:
                self.extra_tables[rid] = [[] for _ in self.windows[1:]]
        tables = self._tables(rid)
        hits = [list(new_computed_blocks)] if self.flat else (list(new_computed_blocks) or [[] for _ in self.windows])
        bs = self.block_size
        num_computed = req.num_computed_tokens + len(hits[0]) * bs
        num_required = cdiv(num_computed + num_new_tokens, bs)
        need, releasable, plans = 0, 0, []
        for g, blocks in enumerate(tables):
            first = self._first_needed(g, num_computed)   # blocks before it: out of every window to come
            gone = []   # a table's nulls are a prefix (windows only move on): its blocks before `first` end it
            for i in range(min(first, len(blocks)) - 1, -1, -1):
                if blocks[i] is self.null:
                    break
                gone.append(i)
            gone.reverse()   # oldest first: the first to be evicted from the free list
            new = max(0, num_required - len(blocks) - len(hits[g]))
            start = len(blocks) + len(hits[g])
            real = sum(1 for i in range(start, start + new) if i >= first)
            shared = [i for i in range(num_computed // bs, min(len(blocks), num_required))
                      if blocks[i] is not self.null and blocks[i].ref_cnt > 1]
            need += real + len(shared)
            releasable += sum(1 for i in gone if blocks[i].ref_cnt == 1)
            plans.append((first, gone, new, start, shared, real))
        # cached blocks nobody holds sit on the free list; touching them uses up free capacity too; a host tier's hit
        # takes a fresh block to be loaded into
        num_free_hits = sum(1 for g in hits for b in g if isinstance(b, KVCacheBlock) and b is not self.null
                            and b.ref_cnt == 0)
        need += sum(1 for g in hits for b in g if isinstance(b, (TierHit, ConnectorHit)))
        if need > self.pool.num_free_blocks + releasable - num_free_hits:
            if fresh:
                self.req_to_blocks.pop(rid)
                self.extra_tables.pop(rid, None)
            return None
        # every group's hits leave the free list before any block is taken from it: a free cached block one group
        # hits must not become another group's new block; a host tier's hits are pinned before any eviction saves
        if self.tier is not None:
            self.tier.pin(b.slot for g in hits for b in g if isinstance(b, TierHit))
        for g, (blocks, (first, gone, new, start, shared, real)) in enumerate(zip(tables, plans)):
            out = [blocks[i] for i in gone]
            for i in gone:
                blocks[i] = self.null
            self._drop_copies_into(out)
            self.pool.free_blocks(out)
            self.pool.touch([b for b in self._held(hits[g]) if isinstance(b, KVCacheBlock)])
        allocated = []
        for g, (blocks, (first, gone, new, start, shared, real)) in enumerate(zip(tables, plans)):
            for i in shared:
                blocks[i] = self._copy_on_write(blocks[i])
            blocks.extend(self._load(b) if isinstance(b, (TierHit, ConnectorHit)) else b for b in hits[g])
            taken = self.pool.get_new_blocks(real)
            allocated += taken
            taken.reverse()
            blocks.extend(taken.pop() if i >= first else self.null for i in range(start, start + new))
        return allocated

    def _fits(self, req: Request, num_new_tokens: int) -> bool:
        """One group without windows: the request's blocks already hold its next tokens, and none of the blocks
        they write is shared (no copy on write)."""
        blocks = self.req_to_blocks.get(req.request_id)
        if blocks is None:
            return False
        first, end = req.num_computed_tokens // self.block_size, cdiv(req.num_computed_tokens + num_new_tokens,
                                                                        self.block_size)
        return end <= len(blocks) and all(blocks[i].ref_cnt == 1 for i in range(first, end))

    def _load(self, hit: TierHit | ConnectorHit) -> KVCacheBlock:
        """A fresh block for a host-tier or connector hit, cached under its hash, its load queued for the next
        forward."""
        [block] = self.pool.get_new_blocks(1)
        self.pool.cache_block(block, hit.block_hash)
        if isinstance(hit, TierHit):
            self.tier.load(hit, block.block_id)
        else:
            self.connector_loads.append((hit, block.block_id))
        return block

    def take_connector_loads(self) -> list[tuple[ConnectorHit, int]]:
        """The connector's (hit, pool block) loads queued since the last call (for the next forward)."""
        loads, self.connector_loads = self.connector_loads, []
        return loads

    def forget_blocks(self, block_ids: list[int]) -> None:
        """Drop these blocks from the prefix cache (loads that failed: their bytes are not the tokens')."""
        for block_id in block_ids:
            self.pool.uncache(self.pool.blocks[block_id])

    def prompt_block_hashes(self, req: Request) -> list[BlockHash]:
        """The hashes of the request's full prompt blocks."""
        self._update_block_hashes(req, req.num_prompt_tokens)
        return req.block_hashes[:req.num_prompt_tokens // self.block_size]

    def take_tier_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's (saves, loads) queued since the last call (for the next forward), or none."""
        return self.tier.take_copies() if self.tier is not None else ([], [])

    def _copy_on_write(self, block: KVCacheBlock) -> KVCacheBlock:
        [copy] = self.pool.get_new_blocks(1)
        self.pending_copies.append((block.block_id, copy.block_id))
        self.pool.free_blocks([block])
        return copy

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies queued since the last call (for the next forward pass)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, src: Request, dst: Request) -> None:
        """Let `dst` share every block `src` holds (parallel samples of one prompt)."""
        tables = self._tables(src.request_id)
        for blocks in tables:
            self.pool.touch(self._held(blocks))
        self.req_to_blocks[dst.request_id] = list(tables[0])
        if len(tables) > 1:
            self.extra_tables[dst.request_id] = [list(b) for b in tables[1:]]
        self.num_cached_blocks[dst.request_id] = self.num_cached_blocks.get(src.request_id, 0)

    def free_tail(self, req: Request, num_tokens: int) -> int:
        """Free the request's blocks past the first `num_tokens` tokens (those only drafts used); returns how many."""
        keep = cdiv(num_tokens, self.block_size)
        freed = 0
        for blocks in self._tables(req.request_id):
            if len(blocks) <= keep:
                continue
            tail = self._held(blocks[keep:])
            del blocks[keep:]
            self._drop_copies_into(tail)
            self.pool.free_blocks(reversed(tail))
            freed += len(tail)
        return freed

    def free(self, req: Request) -> None:
        """Release the request's blocks; the tail goes on the free list first, so it is evicted first."""
        tables = self._tables(req.request_id)
        self.req_to_blocks.pop(req.request_id, None)
        self.extra_tables.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        for blocks in tables:
            held = self._held(blocks)
            self._drop_copies_into(held)
            self.pool.free_blocks(reversed(held))

    def _drop_copies_into(self, blocks: list[KVCacheBlock]) -> None:
        # a copy into a block freed in the same step (a preempted or aborted request's copy-on-write) must not
        # run: the block may be handed out again before the forward, even as another copy's destination
        if self.pending_copies:
            freed = {b.block_id for b in blocks}
            self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in freed]
        # likewise a host-tier or connector load into a block no other request holds (one that hit the block in
        # this step reads it after the load); the block leaves the prefix cache: its bytes will not be its tokens'
        last = {b.block_id for b in blocks if b.ref_cnt == 1}
        dropped = []
        if self.tier is not None and self.tier.loads and last:
            dropped += self.tier.drop_loads_into(last)
        if self.connector_loads and last:
            dropped += [block for _, block in self.connector_loads if block in last]
            self.connector_loads = [(hit, block) for hit, block in self.connector_loads if block not in last]
        self.forget_blocks(dropped)

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.tier is not None:
            self.tier.reset()
        return True

    def _extra_keys(self, req: Request) -> tuple:
        return tuple(k for k in (("lora", req.lora_id) if req.lora_id else None,
                                 ("salt", req.cache_salt) if req.cache_salt else None) if k)

    def _update_block_hashes(self, req: Request, num_tokens: int) -> None:
        bs = self.block_size
        extra = self._extra_keys(req)
        while len(req.block_hashes) < num_tokens // bs:
            i = len(req.block_hashes)
            parent: BlockHash | None = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash_block_tokens(parent, req.all_token_ids[i * bs:(i + 1) * bs], extra))

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's blocks whose KV is fully written (called after each step): the draft model's
        too, which lags by the last draft of a verification that accepted all (Request.draft_kv_end)."""
        if not self.enable_caching:
            return
        num_full = min(req.num_computed_tokens, req.draft_kv_end) // self.block_size
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(req, num_full * self.block_size)
        for g, blocks in enumerate(self._tables(req.request_id)):
            for i in range(start, num_full):
                if blocks[i] is not self.null:
                    self.pool.cache_block(blocks[i], self._group_hash(req.block_hashes[i], g))
        self.num_cached_blocks[req.request_id] = num_full
