"""N-gram proposer (prompt lookup decoding): the tokens that followed the sequence's last n tokens the previous
time those n tokens occurred in it. Pays off where the output copies its input (edits, rewrites, code)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.spec_decode.config import spec_len


class NgramProposer:
    """Looks up the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min) earlier in the sequence.

    With `max_spec_factor`, a draft is at most factor x as long as the match: how far back the occurrence found
    agrees with the sequence (n tokens, or more where the tokens before both agree too). A 2-token match is weak
    evidence and drafts little; a long one, a copy under way, drafts up to k."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_spec_factor: float | None = None):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_spec_factor = max_spec_factor

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
                hit = int(hits[-1])   # the most recent occurrence: in edits, the nearest context is the best
                if self.max_spec_factor is not None:
                    k = min(k, spec_len(self.max_spec_factor, self._match_len(seq, hit, n, k)))
                return seq[hit + n:hit + n + k].tolist()
        return []

    def _match_len(self, seq: np.ndarray, hit: int, n: int, k: int) -> int:
        """How many tokens before seq[hit + n] agree with the sequence's last ones: n, plus the tokens before both
        that agree too; counted only as far as a draft of k needs."""
        need = int(np.ceil(k / self.max_spec_factor))
        m, end = n, len(seq)
        while m < need and hit - (m - n) - 1 >= 0 and seq[hit - (m - n) - 1] == seq[end - m - 1]:
            m += 1
        return m

    def finish(self, request_id: str, token_ids: list[int] | None, num_prompt_tokens: int) -> None:
        """Nothing to forget: the proposer keeps no state between calls."""
