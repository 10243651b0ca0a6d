"""The LoRA seam of the model. Every adaptable Linear holds one LoRAWeights: the adapter slots of that linear
(A and scale * B^T for each of max_loras slots, float32). Every step sets one LoRAMapping, each row's slot, that all
of them read. A linear then computes y = x W (+ b) + (x A) B for each row's adapter:

    rows:     | req0 (sql) x5 | req1 (base) x1 | req2 (chat) x1 | req3 (sql) x3 |
    row_slot: | 0 0 0 0 0     | -1             | 1              | 0 0 0         |
    per slot: rows {0..4, 7..9} x A[0] -> B[0];  rows {6} x A[1] -> B[1];  row 5 pays nothing

The modules call LoRAWeights.apply; the fused C++ layer stack calls the same kernel (kvserve/csrc/lora.cpp) on the
same tables (kvserve/model/fused.py), so both paths give the same bits. The model code never changes per adapter.
"""
from __future__ import annotations

import numpy as np
import torch

from kvserve import kernels
from kvserve.model.linear_roles import roles_of
from kvserve.transfer import to_device


class LoRAMapping:
    """The adapter slot of each row of the current step: row_slot int32 [T] (-1: the base model), None when no
    row has an adapter (then no linear does any LoRA work)."""

    def __init__(self):
        self.row_slot: torch.Tensor | None = None
        self._row_slot_np: np.ndarray | None = None
        self._groups: list[tuple[int, torch.Tensor]] | None = None

    def set(self, row_slot: np.ndarray, device: torch.device) -> None:
        if not (row_slot >= 0).any():
            self.clear()
            return
        self._row_slot_np, self._groups = row_slot, None
        self.row_slot = to_device(row_slot.astype(np.int32), torch.int32, device)

    def clear(self) -> None:
        self.row_slot, self._row_slot_np, self._groups = None, None, None

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, its rows) for the torch path, built on its first use in a step (the C++ kernel groups itself)."""
        if self._groups is None:
            rows = self._row_slot_np
            device = self.row_slot.device
            self._groups = [] if rows is None else [(int(s), to_device(np.flatnonzero(rows == s), torch.long, device))
                                                   for s in np.unique(rows) if s >= 0]
        return self._groups


class LoRAWeights:
    """The adapter slots of one linear [K -> N], whose output columns are `shard_sizes` projections (q|k|v)."""

    def __init__(self, in_features: int, shard_sizes: list[int], max_loras: int, max_rank: int,
                 mapping: LoRAMapping, device: torch.device):
        n = sum(shard_sizes)
        self.mapping = mapping
        self.offsets = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)
        # float32 whatever torch's default dtype (process-wide: another thread may be loading a model in bf16)
        self.a = torch.zeros(max_loras, len(shard_sizes), max_rank, in_features, dtype=torch.float32, device=device)
        self.bt = torch.zeros(max_loras, max_rank, n, dtype=torch.float32, device=device)
        self.ranks = torch.zeros(max_loras, len(shard_sizes), dtype=torch.int32)   # host: the kernel's and ours
        self.desc = torch.tensor([max_loras, len(shard_sizes), max_rank, in_features, n, self.a.data_ptr(),
                                  self.bt.data_ptr(), self.ranks.data_ptr(), *self.offsets], dtype=torch.int64)
        self.desc_ptr = self.desc.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.bt.nbytes

    def set_slot(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put an adapter's A [r, K] and scale * B [N_shard, r] for one shard into `slot`."""
        r = a.shape[0]
        start, end = self.offsets[shard], self.offsets[shard + 1]
        self.a[slot, shard, :r].copy_(a)
        self.bt[slot, :r, start:end].copy_(b.t())
        self.ranks[slot, shard] = r

    def clear_slot(self, slot: int) -> None:
        """The slot's adapter no longer touches this linear (its stale values are never read: ranks say so)."""
        self.ranks[slot] = 0

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[T, N] += the LoRA delta of x[T, K] for the rows of the step's mapping that have an adapter."""
        rows = self.mapping.row_slot
        lib = kernels.load() if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) else None
        if lib is None or y.dtype != x.dtype or y.dim() != 2 or y.stride(1) != 1:
            self.apply_torch(x, y)
            return
        if x.dim() != 2 or x.stride(1) != 1:
            x = x.reshape(-1, x.shape[-1]).contiguous()
        lib.kvserve_lora_add(self.desc_ptr, x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, y.data_ptr(),
                             y.stride(0), x.shape[0], rows.data_ptr())

    def apply_torch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """apply() in torch ops (off the CPU, or without the C++ kernels): float32 sums, rounded once into y."""
        ranks = self.ranks.numpy()
        for slot, idx in self.mapping.groups:
            xs = x[idx].float()
            for shard in np.flatnonzero(ranks[slot]):
                r = int(ranks[slot, shard])
                cols = slice(int(self.offsets[shard]), int(self.offsets[shard + 1]))
                delta = (xs @ self.a[slot, shard, :r].t()) @ self.bt[slot, :r, cols]
                y[idx, cols] = (y[idx, cols].float() + delta).to(y.dtype)


def _adaptable_linears(layer, roles):
    """(name, linear, shard sizes) of a decoder layer's adaptable linears: the declared ones every layer has
    (roles_of: an MoE model's experts take no adapter)."""
    for role in roles:
        linear = role.of(layer)
        yield role.name, linear, list(getattr(linear, "shard_sizes", {None: linear.weight.shape[0]}).values())


def install_lora(model: torch.nn.Module, max_loras: int, max_rank: int) -> tuple[LoRAMapping, dict]:
    """Give every adaptable linear of a decoder model its adapter slots; returns the step mapping they share
    and {(layer, linear name): LoRAWeights}."""
    device = model.model.norm.weight.device   # never a shape-only (meta) weight
    mapping = LoRAMapping()
    tables = {}
    roles = roles_of(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        for name, linear, sizes in _adaptable_linears(layer, roles):
            linear.lora = tables[(i, name)] = LoRAWeights(linear.weight.shape[1], sizes, max_loras, max_rank,
                                                          mapping, device)
    model.model.lora_mapping = mapping
    return mapping, tables


def projection_shapes(model: torch.nn.Module) -> dict[tuple[str, int], tuple[int, int]]:
    """(linear name, shard) -> (in features, out features) of every projection an adapter may target."""
    return {(name, s): (linear.weight.shape[1], size)
            for name, linear, sizes in _adaptable_linears(model.model.layers[0], roles_of(model.model.layers))
            for s, size in enumerate(sizes)}
