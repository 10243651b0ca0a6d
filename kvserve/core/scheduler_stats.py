"""The scheduler's counters as the metrics and the stat logger read them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative counts of verified drafts (vLLM's spec_decode metrics)."""

    num_drafts: int = 0             # requests-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_pos: list[int] = field(default_factory=list)   # [i]: drafts accepted at position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_per_pos) < num_draft_tokens:
            self.num_accepted_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_per_pos))
        for i in range(num_accepted):
            self.num_accepted_per_pos[i] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_per_pos))


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    running_lora_ids: set[int] = field(default_factory=set)   # adapters of the running requests
    waiting_lora_ids: set[int] = field(default_factory=set)
    kv_tier_saved_blocks: int = 0    # the host tier (kvserve/core/host_tier.py): blocks kept there
    kv_tier_loaded_blocks: int = 0   # and loaded back instead of recomputed
    kv_transfer_saved_blocks: int = 0    # the KV connector (kvserve/kv_transfer): blocks saved to its store
    kv_transfer_loaded_blocks: int = 0   # and loaded from it instead of computed
    kv_transfer_seconds: float = 0.0     # time spent in the connector's saves and loads
