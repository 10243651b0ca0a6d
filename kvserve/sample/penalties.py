"""Repetition (HF style), frequency and presence penalties, batched over rows."""
from __future__ import annotations

import torch

from kvserve.sample.metadata import PenaltyTensors


def token_counts(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, V] occurrence counts of the padded [B, L] ids; the pad id (vocab_size) is dropped."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=dtype, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Penalized copy of `logits` [B, V]: repetition, then frequency and presence."""
    vocab_size = logits.shape[1]
    output_counts = token_counts(penalties.output_token_ids, vocab_size, logits.dtype)
    in_output = output_counts > 0
    if penalties.prompt_token_ids is not None:
        seen = in_output | (token_counts(penalties.prompt_token_ids, vocab_size, logits.dtype) > 0)
        logits = apply_repetition_penalty(logits, seen, penalties.repetition)
    logits = logits - penalties.frequency.unsqueeze(1) * output_counts
    return logits - penalties.presence.unsqueeze(1) * in_output


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Seen tokens: positive logits divided by the penalty, the others multiplied (HF/CTRL)."""
    scale = torch.where(seen, penalty.unsqueeze(1), 1.0)
    return torch.where(logits > 0, logits / scale, logits * scale)
