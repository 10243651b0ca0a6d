"""StepMessage: everything a rank needs to run one step's forward, as plain arrays (no live request objects).

The driver builds it from the scheduler's output (ModelRunner.prepare_inputs), runs it itself, and sends it to the
other tensor-parallel ranks, which run exactly the same forward and the same compute_logits calls (the LM head is
vocab-parallel: every rank takes part in every one). Encoded as a JSON header and the arrays' raw bytes: nothing
is unpickled on the receiving side.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, fields

import numpy as np

from kvserve.attention.metadata import flatten_tables, pad_tables


@dataclass
class StepMessage:
    """One step: the tokens, their positions, each sequence's query and total lengths and block table, the
    copy-on-write block copies to do first, and the row sets of the step's compute_logits calls, in call order."""

    input_ids: np.ndarray        # int64 [T]
    positions: np.ndarray        # int64 [T]
    query_lens: np.ndarray       # int64 [B]
    seq_lens: np.ndarray         # int64 [B]
    block_tables: np.ndarray     # int64 [sum of table lengths], each sequence's blocks one after another, group by
    table_lens: np.ndarray       # int64 [G * B]             group (KV groups, kvserve/core/kv_groups.py)
    block_copies: np.ndarray     # int64 [C, 2] (source, destination)
    logits_rows: np.ndarray      # int64 [sum of call lengths]: the hidden rows of each compute_logits call
    logits_lens: np.ndarray      # int64 [calls]
    lora_rows: np.ndarray        # int64 [T] each row's LoRA slot (-1: none); empty when no row has one
    lora_slots: list = field(default_factory=list)   # [slot, adapter id, name, path] of the step's adapters

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def tables(self) -> list[list[int]]:
        """Each sequence's block table of the first KV group."""
        return _split(self.block_tables, self.table_lens)[:len(self.query_lens)]

    def padded_tables(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every KV group's tables, padded (pad_tables) [B, the longest], with their lengths [B]."""
        b = len(self.query_lens)
        if not b:
            return [(pad_tables(self.block_tables[:0], self.table_lens[:0], 1), self.table_lens[:0])]
        ends = np.cumsum(self.table_lens)
        out = []
        for g in range(0, len(self.table_lens), b):
            lens = self.table_lens[g:g + b]
            start = int(ends[g - 1]) if g else 0
            out.append((pad_tables(self.block_tables[start:int(ends[g + b - 1])], lens, 1), lens))
        return out

    def logits_calls(self) -> list[np.ndarray]:
        """The rows of every compute_logits call of the step, in order."""
        ends = np.cumsum(self.logits_lens)
        return [self.logits_rows[e - n:e] for e, n in zip(ends, self.logits_lens)]

    @staticmethod
    def build(input_ids, positions, query_lens, seq_lens, tables: list, block_copies,
              logits_calls: list, lora_rows=(), lora_slots: list = ()) -> StepMessage:
        """tables: each sequence's block table, or (several KV groups) each sequence's tables, one per group."""
        if tables and tables[0] and isinstance(tables[0][0], list):
            tables = [seq[g] for g in range(len(tables[0])) for seq in tables]   # group-major
        flat, lens = flatten_tables(tables)
        rows = np.concatenate([np.asarray(r, np.int64) for r in logits_calls]) if logits_calls else []
        return StepMessage(_i64(input_ids), _i64(positions), _i64(query_lens), _i64(seq_lens), flat,
                           lens, _i64(block_copies).reshape(-1, 2), _i64(rows),
                           _i64([len(r) for r in logits_calls]), _i64(lora_rows), list(lora_slots))

    def encode(self) -> bytes:
        arrays = [np.ascontiguousarray(getattr(self, name), np.int64) for name in _ARRAYS]
        header = json.dumps({"arrays": [[name, list(a.shape)] for name, a in zip(_ARRAYS, arrays)],
                             "lora_slots": self.lora_slots}).encode()
        return struct.pack("<I", len(header)) + header + b"".join(a.tobytes() for a in arrays)

    @staticmethod
    def decode(data: bytes) -> StepMessage:
        (n,) = struct.unpack_from("<I", data)
        meta = json.loads(data[4:4 + n])
        header = meta.get("arrays") if isinstance(meta, dict) else None
        if not isinstance(header, list) or [name for name, _ in header] != list(_ARRAYS):
            raise ValueError("not a StepMessage")
        offset, values = 4 + n, {"lora_slots": meta["lora_slots"]}
        for name, shape in header:
            count = int(np.prod(shape, dtype=np.int64))
            values[name] = np.frombuffer(data, np.int64, count, offset).reshape(shape).copy()   # writable
            offset += 8 * count
        if offset != len(data):
            raise ValueError("StepMessage has trailing bytes")
        return StepMessage(**values)


_ARRAYS = tuple(f.name for f in fields(StepMessage) if f.name != "lora_slots")


def _i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _split(flat: np.ndarray, lens: np.ndarray) -> list[list[int]]:
    out, start = [], 0
    values = flat.tolist()
    for n in lens.tolist():
        out.append(values[start:start + n])
        start += n
    return out
