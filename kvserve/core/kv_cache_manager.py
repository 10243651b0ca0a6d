"""KVCacheManager: each request's block table, slot allocation and prefix-cache lookups.

    request tokens:  | block 0 | block 1 | block 2 | blk 3 (partial) |
    cached (hit):    |<---- get_computed_blocks ---->|
    computed:        |<---------- num_computed_tokens ------->|
    allocate_slots:  makes room for the next num_new_tokens, taking new blocks only when the tail is full

Forked requests (the n samples of one prompt) share blocks; the first write into a block that another
request still holds copies it first (copy-on-write): allocate_slots swaps in a fresh block and queues
a (src, dst) copy that the model runner performs before the forward pass.
"""
from __future__ import annotations

from kvserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from kvserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the BlockPool; maps request ids to their blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # leading blocks of the request already in the cache map
        self.pending_copies: list[tuple[int, int]] = []   # copy-on-write (src, dst) block ids for the next forward

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks for this request's tokens, and how many tokens they hold."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return [], 0   # prompt logprobs need every prompt position computed
        self._update_block_hashes(req, req.num_tokens)
        # the last token is always recomputed so there are logits to sample from
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in req.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens; None when the pool cannot (preempt or wait)."""
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        shared = [i for i in range(num_computed // self.block_size, min(len(blocks), num_required))
                  if blocks[i].ref_cnt > 1]
        # cached blocks nobody holds sit on the free list; touching them uses up free capacity too
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + len(shared) > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_to_blocks[req.request_id]
            return None
        for i in shared:
            blocks[i] = self._copy_on_write(blocks[i])
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

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
        blocks = self.req_to_blocks[src.request_id]
        self.pool.touch(blocks)
        self.req_to_blocks[dst.request_id] = list(blocks)
        self.num_cached_blocks[dst.request_id] = self.num_cached_blocks.get(src.request_id, 0)

    def free_tail(self, req: Request, num_tokens: int) -> int:
        """Free the request's blocks past the first `num_tokens` tokens (those only drafts used); returns how many."""
        blocks = self.req_to_blocks.get(req.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self._drop_copies_into(tail)
        self.pool.free_blocks(reversed(tail))
        return len(tail)

    def free(self, req: Request) -> None:
        """Release the request's blocks; the tail goes on the free list first, so it is evicted first."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self._drop_copies_into(blocks)
        self.pool.free_blocks(reversed(blocks))

    def _drop_copies_into(self, blocks: list[KVCacheBlock]) -> None:
        # a copy into a block freed in the same step (a preempted or aborted request's copy-on-write) must not
        # run: the block may be handed out again before the forward, even as another copy's destination
        if self.pending_copies:
            freed = {b.block_id for b in blocks}
            self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in freed]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

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
        blocks = self.req_to_blocks[req.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], req.block_hashes[i])
        self.num_cached_blocks[req.request_id] = num_full
