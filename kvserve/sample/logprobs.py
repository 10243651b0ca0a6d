"""Logprobs of sampled and prompt tokens: the token's own, its rank and the top K."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    """Column 0 is the chosen token, columns 1..K the top K in descending order."""

    token_ids: torch.Tensor  # [N, K+1] long
    logprobs: torch.Tensor   # [N, K+1] float32
    ranks: torch.Tensor      # [N] long, rank of the column-0 token (1 = most likely)

    def on_host(self) -> "LogprobRows":
        """The rows on the host (one read of each tensor), to build per-token dicts from."""
        return LogprobRows(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())


@dataclass
class LogprobRows:
    """LogprobsTensors' rows as host lists."""

    ids: list[list[int]]
    vals: list[list[float]]
    ranks: list[int]

    def dict(self, i: int, k: int) -> dict:
        """Row i as the dict a request carries per token: token id -> Logprob, the chosen token first
        (Request.truncate_output relies on it), then the top k (the chosen one may repeat among them)."""
        from kvserve.outputs import Logprob
        ids, vals = self.ids[i], self.vals[i]
        d = {ids[0]: Logprob(vals[0], self.ranks[i])}
        for j in range(1, k + 1):
            d.setdefault(ids[j], Logprob(vals[j], j))
        return d


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Pick the chosen tokens' logprobs, ranks and the top k out of full [N, V] logprobs."""
    top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    # Ties count against the token, as in vLLM: rank = number of tokens at least as likely.
    ranks = (logprobs >= token_logprobs).sum(dim=-1, dtype=torch.int32).long()   # int32: twice as fast as int64
    return LogprobsTensors(token_ids=torch.cat([token_ids, top_ids], dim=-1),
                           logprobs=torch.cat([token_logprobs, top_logprobs], dim=-1),
                           ranks=ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Raw float32 logprobs of each prompt position's actual next token, its rank and the top k."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_token_ids.long(), k)
