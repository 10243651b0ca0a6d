"""Logit bias, allowed tokens, bans (min_tokens, bad words), penalties and the grammar bitmask: the processors that
run before greedy and random sampling."""
from __future__ import annotations

import torch

from kvserve.sample.metadata import AllowedTokens, SamplingMetadata, SparseLogits
from kvserve.sample.penalties import apply_penalties
from kvserve.structured_output.request import apply_grammar_bitmask


def apply_logit_bias(logits: torch.Tensor, bias: SparseLogits) -> torch.Tensor:
    """Add each row's bias to its tokens, in place."""
    # Flat ids (row * V + token) come from the host, so this is one scatter kernel and no sync.
    logits.view(-1).index_add_(0, bias.flat_ids, bias.values)
    return logits


def apply_banned(logits: torch.Tensor, mask: SparseLogits) -> torch.Tensor:
    """Forbid the entries of `mask` (stop tokens under min_tokens, bad words), in place."""
    logits.view(-1).index_fill_(0, mask.flat_ids, float("-inf"))
    return logits


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """Set every entry of the restricted rows outside their allowed tokens to -inf, in place."""
    logits[allowed.rows] = logits[allowed.rows].masked_fill(~allowed.keep, float("-inf"))
    return logits


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Logits after bias, allowed tokens, bans (min_tokens, bad words), penalties and the grammar; `logits` itself
    is never modified."""
    if (meta.logit_bias is not None or meta.banned is not None or meta.allowed is not None
            or meta.grammar_bitmask is not None):
        # Contiguous, so the flat ids built for a row-major [B, V] address the right entries.
        logits = logits.clone(memory_format=torch.contiguous_format)
        if meta.logit_bias is not None:
            apply_logit_bias(logits, meta.logit_bias)
        if meta.allowed is not None:
            apply_allowed(logits, meta.allowed)
        if meta.banned is not None:
            apply_banned(logits, meta.banned)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    if meta.grammar_bitmask is not None:   # last, on the contiguous copy made above (or the penalties' result)
        apply_grammar_bitmask(logits, meta.grammar_bitmask)
    return logits
