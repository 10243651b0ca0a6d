"""Pooling in the model runner: a pooling request's hidden states become one vector as its prompt is computed.

MEAN sums each chunk's rows as they come (a preempted request starts again from zero), CLS keeps the first row,
LAST takes the row of the prompt's last token; the step that computes that token finishes the vector (its first
`dimensions` values, normalized to unit length where asked) and the request.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PoolingState:
    """A pooling request's resolved parameters and what its steps have pooled so far."""

    pooling_type: str          # LAST | MEAN | CLS
    normalize: bool
    dimensions: int | None
    whole: bool                # an encoder's request: the whole prompt in one step
    total: torch.Tensor | None = None
    embedding: list[float] | None = None

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hit may skip one)."""
        return self.pooling_type != "LAST" or self.whole


def pool_step(hidden: torch.Tensor, spans) -> dict[str, list[int]]:
    """spans: (request, first row, rows, first position) of each pooling request in the step. Returns the ids of
    the requests whose vector is complete, each with no token to emit."""
    done = {}
    for req, row, n, start in spans:
        state = req.pooling
        rows = hidden[row:row + n]
        if state.pooling_type == "MEAN":
            part = rows.float().sum(0)
            state.total = part if start == 0 or state.total is None else state.total + part
        elif state.pooling_type == "CLS" and start == 0:
            state.total = rows[0].float().clone()   # not a view that keeps (or, under CUDA graphs, loses) the step
        if start + n < req.num_tokens:
            continue
        if state.pooling_type == "LAST":
            vector = rows[-1].float()
        else:
            vector = state.total / req.num_tokens if state.pooling_type == "MEAN" else state.total
        if state.dimensions is not None:
            vector = vector[:state.dimensions]
        if state.normalize:
            vector = F.normalize(vector, dim=0)
        state.embedding = vector.cpu().tolist()
        state.total = None
        done[req.request_id] = []
    return done
