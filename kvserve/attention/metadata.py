"""AttentionMetadata: how one step's flattened tokens map onto sequences and paged KV slots.

A step's tokens are flattened over all scheduled sequences (no batch dimension):

    tokens:   | seq0 q0..q4 | seq1 q0 | seq2 q0 | seq3 q0..q2 |
    context:  each sequence attends to its whole KV (cached + new), read through its block table.

Every backend gets the flat arrays (query_start_loc, seq_lens, a padded block table). The pure-torch
reference backend also needs padded gather indices and masks; those `groups` are built on first use only.
It splits the sequences into two groups, decodes (one query token) and prefills (several), each padded to
its own longest query and context, so one long prompt chunk never pads a batch of decodes to its length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from kvserve.transfer import to_device


@dataclass
class AttnGroup:
    """Padded index tensors for a group of sequences, shared by every layer of one step."""

    token_rows: torch.Tensor   # [n_valid] row of each valid (seq, query) pair in the flattened step
    query_idx: torch.Tensor    # [G, max_q] flattened-token index per (seq, query), padding -> 0
    valid_idx: torch.Tensor    # [n_valid] positions of valid entries in query_idx.flatten()
    ctx_slots: torch.Tensor    # [G, max_ctx] KV slot of each context position, padding -> 0
    mask: torch.Tensor         # [G, 1, max_q, max_ctx] True where attention is allowed
    query_pos: torch.Tensor    # [G, max_q] absolute position of each query (padding: max_ctx, sees everything)
    max_q: int


@dataclass
class AttentionMetadata:
    """One step's attention inputs; built once per step on the host and shared by all layers."""

    num_tokens: int
    slot_mapping: torch.Tensor     # [T] KV slot (block_id * block_size + offset) of every new token
    query_lens: np.ndarray         # [B] new tokens per sequence
    seq_lens: np.ndarray           # [B] context length after this step (cached + new)
    host_tables: np.ndarray        # [B, max blocks] int64 physical block ids per sequence, padded with 0
    table_lens: np.ndarray         # [B] int64 blocks in each sequence's table
    block_size: int
    query_start_loc: torch.Tensor  # [B + 1] int32: first flattened row of each sequence, then T
    seq_lens_tensor: torch.Tensor  # [B] int32
    block_table_tensor: torch.Tensor  # [B, max blocks] int32, padded with 0
    device: torch.device | str = "cpu"
    # the metadata of KV groups 1, 2, ... (kvserve/core/kv_groups.py): the same tokens through their block tables
    kv_groups: list[AttentionMetadata] = field(default_factory=list, repr=False)
    _groups: list[AttnGroup] | None = field(default=None, repr=False)
    _kernel_args: tuple | None = field(default=None, repr=False)

    @property
    def block_tables(self) -> list[list[int]]:
        """Each sequence's block ids, as lists (host_tables unpadded)."""
        return [row[:n] for row, n in zip(self.host_tables.tolist(), self.table_lens.tolist())]

    @property
    def kernel_args(self) -> tuple[int, int, int, int, int, int]:
        """(slot mapping, block table, its row stride, seq lens, query starts, number of sequences): the raw
        pointers the C++ kernels take, read once per step instead of once per layer."""
        if self._kernel_args is None:
            t = self.block_table_tensor
            self._kernel_args = (self.slot_mapping.data_ptr(), t.data_ptr(), t.stride(0),
                                 self.seq_lens_tensor.data_ptr(), self.query_start_loc.data_ptr(),
                                 self.seq_lens_tensor.shape[0])
        return self._kernel_args

    @property
    def groups(self) -> list[AttnGroup]:
        """Padded gather indices and masks for the torch reference backend (built on first use)."""
        if self._groups is None:
            self._groups = _build_groups(self)
        return self._groups


def flatten_tables(block_tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(every table's ids one table after another, each table's length), int64."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    return np.fromiter(chain.from_iterable(block_tables), dtype=np.int64, count=int(lens.sum())), lens


def padded_block_tables(block_tables: list[list[int]], min_blocks: int) -> np.ndarray:
    """[B, max(len, min_blocks)] int64 array of the block tables, padded with 0."""
    return pad_tables(*flatten_tables(block_tables), min_blocks)


def pad_tables(flat: np.ndarray, lens: np.ndarray, min_blocks: int) -> np.ndarray:
    """padded_block_tables of tables given as their ids one table after another (`flat`) and their lengths."""
    out = np.zeros((len(lens), max(int(lens.max(initial=0)), min_blocks, 1)), dtype=np.int64)
    if len(lens):
        out[np.arange(out.shape[1])[None, :] < lens[:, None]] = flat   # row-major: each row's ids in order
    return out


def _build_group(seqs: np.ndarray, q_start: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
                 tables: np.ndarray, block_size: int, device) -> AttnGroup:
    ql, sl, qs = query_lens[seqs], seq_lens[seqs], q_start[seqs]
    max_q, max_ctx = int(ql.max()), int(sl.max())
    q_ar, ctx_ar = np.arange(max_q), np.arange(max_ctx)
    q_valid = q_ar[None, :] < ql[:, None]                                    # [G, max_q]
    query_idx = np.where(q_valid, qs[:, None] + q_ar[None, :], 0)
    ctx_valid = ctx_ar[None, :] < sl[:, None]
    blocks = tables[seqs][:, np.minimum(ctx_ar // block_size, tables.shape[1] - 1)]
    ctx_slots = np.where(ctx_valid, blocks * block_size + ctx_ar % block_size, 0)
    # query j sits at absolute position sl - ql + j and sees keys 0..that position (causal);
    # padded queries see everything so their softmax stays finite (their rows are dropped)
    limit = np.where(q_valid, (sl - ql)[:, None] + q_ar[None, :], max_ctx)   # [G, max_q]
    mask = (ctx_ar[None, None, :] <= limit[:, :, None])[:, None]             # [G, 1, max_q, max_ctx]
    flat_valid = np.flatnonzero(q_valid.reshape(-1))
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
    return AttnGroup(token_rows=to(query_idx.reshape(-1)[flat_valid]), query_idx=to(query_idx),
                     valid_idx=to(flat_valid), ctx_slots=to(ctx_slots), mask=to(mask), query_pos=to(limit),
                     max_q=max_q)


def _build_groups(meta: AttentionMetadata) -> list[AttnGroup]:
    q_start = meta.query_start_loc.cpu().numpy()[:-1].astype(np.int64)
    tables = meta.block_table_tensor.cpu().numpy().astype(np.int64)
    is_decode = meta.query_lens == 1
    return [_build_group(s, q_start, meta.query_lens, meta.seq_lens, tables, meta.block_size, meta.device)
            for s in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode)) if len(s)]


def build_attention_metadata(query_lens, seq_lens, block_tables: list[list[int]], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """Build the metadata for sequences with `query_lens` new tokens each, ending at `seq_lens`."""
    flat, lens = flatten_tables(block_tables)
    return metadata_from_tables(query_lens, seq_lens, pad_tables(flat, lens, 1), lens, block_size, device)


def metadata_from_tables(query_lens, seq_lens, tables: np.ndarray, table_lens: np.ndarray, block_size: int,
                         device: torch.device | str = "cpu") -> AttentionMetadata:
    """build_attention_metadata from the block tables padded already (pad_tables) and their lengths."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    # every new token: its sequence, its absolute position, then its slot through the block table
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    pos = np.arange(num_tokens) - query_start[:-1][seq_of_token] + (seq_lens - query_lens)[seq_of_token]
    slot_mapping = tables[seq_of_token, pos // block_size] * block_size + pos % block_size
    to32 = lambda a: to_device(a.astype(np.int32), torch.int32, device)
    return AttentionMetadata(num_tokens=num_tokens, slot_mapping=to_device(slot_mapping, torch.long, device),
                             query_lens=query_lens, seq_lens=seq_lens, host_tables=tables, table_lens=table_lens,
                             block_size=block_size, query_start_loc=to32(query_start), seq_lens_tensor=to32(seq_lens),
                             block_table_tensor=to32(tables), device=device)


def build_group_metadata(query_lens, seq_lens, group_tables: list[tuple[np.ndarray, np.ndarray]], block_size: int,
                         device: torch.device | str = "cpu") -> AttentionMetadata:
    """The metadata of a step over several KV groups, each group's tables padded (pad_tables) with their lengths:
    group 0's, holding the others' (kv_groups)."""
    first, *rest = (metadata_from_tables(query_lens, seq_lens, tables, lens, block_size, device)
                    for tables, lens in group_tables)
    first.kv_groups = rest
    return first


def single_sequence_metadata(num_tokens: int, block_size: int = 16, device="cpu") -> AttentionMetadata:
    """Metadata for one fresh sequence of `num_tokens` tokens in blocks 0, 1, 2, ... (tests, warm-up)."""
    num_blocks = -(-num_tokens // block_size)
    return build_attention_metadata([num_tokens], [num_tokens], [list(range(num_blocks))], block_size, device)
