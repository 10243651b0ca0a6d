"""KV cache groups: layers with a sliding window keep only the blocks their window reaches.

Layers are dealt into groups of equal size, each group all full attention or all one sliding window (Gemma 3's 3
global and 15 local layers: 6 groups of 3; Gemma 2's alternating ones: 2 groups; Mistral's all-local ones: 1).
Every group has its own block table per request, and all groups draw their blocks from one pool: a block id is a
page that holds one block of each of a group's layers, so a layer's K/V pool is shared by the layers at the same
place in every group (its slot) and a page costs the memory of one group, not of the whole model.

A sliding-window group's table keeps the positions of the whole sequence, with the blocks that have left the
window of every query to come replaced by the null block (id 0, reserved): the attention kernels index tables by
position and never read a key outside the window, so they need no change. vLLM's hybrid KV cache manager is the
model; this is our own, smaller code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroups:
    """How a model's layers share the KV pool."""

    windows: tuple[int | None, ...]   # per group: its layers' sliding window, None for full attention
    layer_group: tuple[int, ...]      # per layer: its group
    layer_slot: tuple[int, ...]       # per layer: its place in the group, which names its K/V pool
    group_size: int                   # layers per group: the pools a page spans

    @staticmethod
    def single(num_layers: int) -> KVGroups:
        """One group of every layer, each with its own pool: every block of every layer kept (no windows)."""
        return KVGroups((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @staticmethod
    def from_windows(windows: list[int | None]) -> KVGroups:
        """Groups for layers with these windows (None: full attention), the full-attention ones first."""
        kinds: dict[int | None, list[int]] = {}
        for i, w in enumerate(windows):
            kinds.setdefault(w or None, []).append(i)
        if list(kinds) == [None]:
            return KVGroups.single(len(windows))
        size = math.gcd(*(len(layers) for layers in kinds.values()))
        group_windows, layer_group, layer_slot = [], [0] * len(windows), [0] * len(windows)
        for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            layers = kinds[window]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer], layer_slot[layer] = len(group_windows), slot
                group_windows.append(window)
        return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.windows)

    def live_blocks(self, group: int, num_tokens: int, chunk: int, block_size: int) -> int:
        """At most how many non-null blocks `group` holds for a sequence of num_tokens tokens computed in steps of
        up to `chunk` new tokens (a step's first query sees W - 1 keys before it; the step writes `chunk`)."""
        whole = cdiv(num_tokens, block_size)
        window = self.windows[group]
        return whole if window is None else min(whole, cdiv(window - 1 + chunk, block_size) + 1)

    def blocks_needed(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """Pages one sequence of num_tokens tokens takes at most, over every group."""
        return sum(self.live_blocks(g, num_tokens, chunk, block_size) for g in range(self.num_groups))

    def describe(self) -> str:
        """'6 groups of 3 layers: 1 full, 5 with a 512-token window' (the log's)."""
        full = sum(1 for w in self.windows if w is None)
        local = {w for w in self.windows if w is not None}
        parts = ([f"{full} full"] if full else []) + [
            f"{sum(1 for x in self.windows if x == w)} with a {w}-token window" for w in sorted(local)]
        return f"{self.num_groups} groups of {self.group_size} layers: {', '.join(parts)}"
