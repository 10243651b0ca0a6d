"""N-gram proposer (prompt lookup decoding): the tokens that followed the sequence's last n tokens the previous
time those n tokens occurred in it. Pays off where the output copies its input (edits, rewrites, code)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Looks up the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min) earlier in the sequence."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, request_id: str, token_ids: list[int], num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) draft tokens to follow `token_ids`; [] when no n-gram recurs."""
        k = min(self.k, max_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        seq = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            # windows of seq[:-1] start at 0 .. len - 1 - n, so every match has at least one token after it
            windows = sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n   # the most recent occurrence: in edits, the nearest context is the best
                return seq[start:start + k].tolist()
        return []

    def finish(self, request_id: str, token_ids: list[int] | None, num_prompt_tokens: int) -> None:
        """Nothing to forget: the proposer keeps no state between calls."""
