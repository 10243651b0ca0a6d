"""AttentionMetadata: how one step's flattened tokens map onto sequences and paged KV slots.

A step's tokens are flattened over all scheduled sequences (no batch dimension):

    tokens:   | seq0 q0..q4 | seq1 q0 | seq2 q0 | seq3 q0..q2 |
    context:  each sequence attends to its whole KV (cached + new), read through its block table.

For the vectorized reference backend the sequences are split into two groups, decodes (one query
token) and prefills (several), and each group is padded to its own longest query and context, so
one long prompt chunk never pads a batch of decodes to its length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttnGroup:
    """Padded index tensors for a group of sequences, shared by every layer of one step."""

    token_rows: torch.Tensor   # [n_valid] row of each valid (seq, query) pair in the flattened step
    query_idx: torch.Tensor    # [G, max_q] flattened-token index per (seq, query), padding -> 0
    valid_idx: torch.Tensor    # [n_valid] positions of valid entries in query_idx.flatten()
    ctx_slots: torch.Tensor    # [G, max_ctx] KV slot of each context position, padding -> 0
    mask: torch.Tensor         # [G, 1, max_q, max_ctx] True where attention is allowed
    max_q: int


@dataclass
class AttentionMetadata:
    """One step's attention inputs; built once per step on the host and shared by all layers."""

    num_tokens: int
    slot_mapping: torch.Tensor     # [T] KV slot (block_id * block_size + offset) of every new token
    query_lens: np.ndarray         # [B] new tokens per sequence
    seq_lens: np.ndarray           # [B] context length after this step (cached + new)
    block_tables: list[list[int]]  # [B] physical block ids per sequence
    block_size: int
    groups: list[AttnGroup]


def _slots_for(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return block_table[positions // block_size] * block_size + positions % block_size


def _build_group(seqs: list[int], q_start: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
                 tables: list[np.ndarray], block_size: int, device) -> AttnGroup:
    g = len(seqs)
    max_q = int(query_lens[seqs].max())
    max_ctx = int(seq_lens[seqs].max())
    q_ar = np.arange(max_q)
    ctx_ar = np.arange(max_ctx)
    query_idx = np.zeros((g, max_q), dtype=np.int64)
    ctx_slots = np.zeros((g, max_ctx), dtype=np.int64)
    q_valid = np.zeros((g, max_q), dtype=bool)
    mask = np.zeros((g, 1, max_q, max_ctx), dtype=bool)
    for i, s in enumerate(seqs):
        ql, sl = int(query_lens[s]), int(seq_lens[s])
        query_idx[i, :ql] = q_start[s] + q_ar[:ql]
        q_valid[i, :ql] = True
        ctx_slots[i, :sl] = _slots_for(tables[s], ctx_ar[:sl], block_size)
        # query j sits at absolute position sl - ql + j and sees keys 0..that position (causal)
        limit = (sl - ql + q_ar[:ql])[:, None]
        mask[i, 0, :ql, :] = ctx_ar[None, :] <= limit
    mask[:, 0][~q_valid] = True  # padded queries attend to something so softmax stays finite
    flat_valid = np.flatnonzero(q_valid.reshape(-1))
    to = lambda a: torch.from_numpy(a).to(device)
    return AttnGroup(token_rows=to(query_idx.reshape(-1)[flat_valid]), query_idx=to(query_idx),
                     valid_idx=to(flat_valid), ctx_slots=to(ctx_slots), mask=to(mask), max_q=max_q)


def build_attention_metadata(query_lens, seq_lens, block_tables: list[list[int]], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """Build the metadata for sequences with `query_lens` new tokens each, ending at `seq_lens`."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    tables = [np.asarray(t, dtype=np.int64) for t in block_tables]
    q_start = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)
    slot_parts = [_slots_for(t, np.arange(sl - ql, sl), block_size)
                  for t, ql, sl in zip(tables, query_lens, seq_lens)]
    slot_mapping = np.concatenate(slot_parts) if slot_parts else np.zeros(0, dtype=np.int64)
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q > 1]
    groups = [_build_group(s, q_start, query_lens, seq_lens, tables, block_size, device)
              for s in (decodes, prefills) if s]
    return AttentionMetadata(num_tokens=int(query_lens.sum()), slot_mapping=torch.from_numpy(slot_mapping).to(device),
                             query_lens=query_lens, seq_lens=seq_lens, block_tables=block_tables,
                             block_size=block_size, groups=groups)


def single_sequence_metadata(num_tokens: int, block_size: int = 16, device="cpu") -> AttentionMetadata:
    """Metadata for one fresh sequence of `num_tokens` tokens in blocks 0, 1, 2, ... (tests, warm-up)."""
    num_blocks = -(-num_tokens // block_size)
    return build_attention_metadata([num_tokens], [num_tokens], [list(range(num_blocks))], block_size, device)
