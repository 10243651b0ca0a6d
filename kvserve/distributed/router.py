"""PrefixRouter: which data-parallel replica a request goes to.

The replica whose prefix cache holds the longest prefix of the request's prompt (in whole KV blocks, by the same
chained block hashes as the KV cache manager), else the least loaded one (its requests in flight: running plus
waiting). The router keeps, per replica, the block hashes of the prompts it sent there, most recent last, as
many as the replica's KV cache holds blocks: its view of what that replica has cached.
"""
from __future__ import annotations

from collections import OrderedDict

from kvserve.core.block_pool import hash_block_tokens


class PrefixRouter:
    """Routes by cached prefix, then by load; replicas taken out of rotation are never chosen."""

    def __init__(self, num_replicas: int, block_size: int, blocks_per_replica: int):
        self.block_size = block_size
        self.capacity = blocks_per_replica
        self.cached: list[OrderedDict] = [OrderedDict() for _ in range(num_replicas)]
        self.load = [0] * num_replicas
        self.alive = [True] * num_replicas

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list:
        """Chained hashes of the prompt's full blocks (the last token is always computed, so never cached)."""
        hashes, parent = [], None
        extra = (cache_salt,) if cache_salt else ()
        for start in range(0, len(token_ids) - 1 - (len(token_ids) - 1) % self.block_size, self.block_size):
            parent = hash_block_tokens(parent, token_ids[start:start + self.block_size], extra if not hashes else ())
            hashes.append(parent)
        return hashes

    def choose(self, hashes: list) -> int:
        """The replica for a prompt of these block hashes; ValueError if none is alive."""
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise ValueError("no replica is alive")
        best = max(live, key=lambda i: (self.cached_prefix(i, hashes), -self.load[i], -i))
        return best

    def cached_prefix(self, replica: int, hashes: list) -> int:
        """How many leading blocks of the prompt `replica` holds (as far as the router knows)."""
        cached = self.cached[replica]
        n = 0
        while n < len(hashes) and hashes[n] in cached:
            n += 1
        return n

    def started(self, replica: int, hashes: list) -> None:
        """A request went to `replica`: its prompt's blocks are cached there from now on."""
        self.load[replica] += 1
        cached = self.cached[replica]
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity:
            cached.popitem(last=False)

    def finished(self, replica: int) -> None:
        self.load[replica] -= 1

    def remove(self, replica: int) -> None:
        """Take a dead replica out of rotation."""
        self.alive[replica] = False
        self.cached[replica].clear()
