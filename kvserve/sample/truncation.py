"""Top-k, top-p and min-p: mask the tokens a random row may not sample to -inf."""
from __future__ import annotations

import math

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's highest probability."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); min_p = 0 gives -inf and keeps all.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, -math.inf)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k most likely tokens, then the smallest set of those with mass >= top_p."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        # By position, not by value: exactly k tokens survive even when logits tie.
        positions = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), -math.inf)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # The mass strictly before a token; the top token's is 0 < top_p, so one token always survives.
        mass_before = probs.cumsum(dim=-1) - probs
        p = top_p.unsqueeze(1)
        sorted_logits.masked_fill_((mass_before >= p) & (p < 1.0), -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
