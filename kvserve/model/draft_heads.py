"""A speculative draft model's output matrices: a cut head over the first token ids (restrict_vocab), the rows of
any other ids (row_logits), the head and the layers requantized to Q4_0 (quantize_head_q4_0, quantize_layers_q4_0).
The causal LM (kvserve/model/causal_lm.py) takes them as a mixin: a target never calls them. (Here, not in
spec_decode/: kvserve.model's package imports causal_lm, so a module outside it that imports kvserve.model and is
imported by causal_lm would be found half-initialised whenever it was imported first.)"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch
from torch import nn

from kvserve import kernels
from kvserve.model.layers import Linear
from kvserve.model.linear_method import DENSE, keep_quantized
from kvserve.model.quantization import INT8, INT8_GROUP, QuantizedWeight, is_wider_than_q4_0, to_q4_0


class DraftHeads:
    """Draft-model transformations of a CausalLM's output matrix and layers (its config, model, cut_lm_head,
    _plain_head, _rows_head, tp, _output_matrix and _capped are the CausalLM's)."""

    def row_logits(self, hidden: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
        """float32 logits [N, len(ids)] of the output matrix's rows `ids` only (ascending; after restrict_vocab): a
        cut draft's tokens past its cut. A quantized matrix gives the same bits as those columns of
        compute_logits(hidden); a dense one the same values, up to rounding."""
        if self._rows_head is None or self._rows_head[0] != ids:
            self._rows_head = (ids, *self._head_of_rows(ids))
        _, head, columns = self._rows_head
        logits = self._capped(head(hidden).float())
        return logits if columns is None else logits[:, columns]

    def _head_of_rows(self, ids: tuple[int, ...]) -> tuple[Linear, torch.Tensor | None]:
        """A Linear over rows `ids` of the output matrix, and the columns of its output that are theirs (None: all;
        an INT8 matrix's rows come in interleaved groups of 16, so its whole groups are taken)."""
        if self.cut_lm_head is None:
            raise ValueError("row_logits before restrict_vocab")
        src = self._output_matrix()
        quant = src.quantized
        index = torch.tensor(ids, dtype=torch.long)
        if quant is None:
            head = Linear(self.config.hidden_size, len(ids))
            head.weight = nn.Parameter(self._plain_head[index.to(self._plain_head.device)], requires_grad=False)
            return head, None
        part = quant.segments[0]   # an output matrix or embedding table is one segment
        if part.ggml_type != INT8:
            return self._quantized_head(QuantizedWeight([replace(part, data=part.data[index])]), src.weight.dtype), \
                None
        groups = torch.unique(index // INT8_GROUP)
        rows = (groups[:, None] * INT8_GROUP + torch.arange(INT8_GROUP)).reshape(-1)
        columns = torch.searchsorted(groups, index // INT8_GROUP) * INT8_GROUP + index % INT8_GROUP
        return self._quantized_head(QuantizedWeight([replace(part, data=part.data[rows])]), src.weight.dtype), \
            columns

    def _quantized_head(self, quant: QuantizedWeight, dtype: torch.dtype) -> Linear:
        """A head that multiplies `quant`; its weight is shape-only."""
        n, k = quant.out_features, self.config.hidden_size
        head = Linear(k, n)
        head.weight = nn.Parameter(torch.empty(n, k, dtype=dtype, device="meta"), requires_grad=False)
        keep_quantized(head, quant)
        return head

    def _set_quantized_head(self, quant: QuantizedWeight, dtype: torch.dtype) -> None:
        """A head of its own (untying a tied model's) that multiplies `quant`."""
        self.lm_head = self._quantized_head(quant, dtype)
        self.tied_head = DENSE

    def restrict_vocab(self, n: int) -> None:
        """Logits for the first n token ids as well (compute_logits(cut=True): a speculative draft model's
        proposals): a second output matrix of the first n rows (cut_lm_head), in the format of the whole one, which
        stays (a GGUF head stays quantized; an int8 head's rows come in groups of 16, so n rounds up to the group);
        row_logits gives any other rows (a dense matrix's plain rows are kept for it: prepack() would release them).
        Call after loading and quantize_head_q4_0, before prepack()."""
        src = self._output_matrix()
        quant = src.quantized
        rows = quant.out_features if quant is not None else src.weight.shape[0]
        self._plain_head = self._rows_head = None   # of an earlier cut
        if not 1 <= n <= rows or self.tp is not None:
            raise ValueError(f"restrict_vocab({n}) of a {rows}-row output matrix" +
                             (" on a tensor-parallel shard" if self.tp is not None else ""))
        if quant is not None and len(quant.segments) == 1 and quant.segments[0].ggml_type == INT8:
            n = min(-(-n // INT8_GROUP) * INT8_GROUP, quant.out_features)
        if quant is None:
            head = Linear(self.config.hidden_size, n)
            head.weight = nn.Parameter(src.weight[:n].clone(), requires_grad=False)
            self._plain_head = src.weight.detach()   # a view: packing that consumes the plain weight then spares it
        else:
            part = quant.segments[0]   # an output matrix or embedding table is one segment
            head = self._quantized_head(QuantizedWeight([replace(part, data=part.data[:n])]), src.weight.dtype)
        self.cut_lm_head = head

    def head_format(self) -> str | None:
        """The output matrix's quantized format (Q8_0, Q6_K, INT8, ...); None where it is a plain weight."""
        quant = self._output_matrix().quantized
        return None if quant is None else "+".join(quant.formats())

    def quantize_head_q4_0(self) -> None:
        """The output matrix requantized to Q4_0 (to_q4_0), from its quantized rows or its plain weight, a
        chunk of rows at a time: a speculative draft's head, whose logits only choose what verification checks.
        Call after loading, before restrict_vocab and prepack()."""
        src = self._output_matrix()
        quant, k = src.quantized, self.config.hidden_size
        self._check_q4_0("an output matrix")
        if k % 32:
            raise ValueError(f"the hidden size {k} is not a multiple of 32 (Q4_0's blocks)")
        if self.head_format() == "Q4_0":
            return
        source = src.weight if quant is None else quant.segments[0]   # an output matrix is one segment
        self._set_quantized_head(QuantizedWeight([to_q4_0(source)]), src.weight.dtype)
        self._plain_head = self._rows_head = None   # rows of the old matrix

    def quantize_layers_q4_0(self, stored_only: bool) -> Counter:
        """The decoder layers' linears requantized to Q4_0 (to_q4_0), a speculative draft's (its weights only choose
        what verification checks): each quantized matrix stored in more bits a weight than Q4_0
        (is_wider_than_q4_0), and unless stored_only each plain weight too. Returns the formats replaced, with how
        many matrices of each ("plain" for a plain weight). Call after loading, before prepack()."""
        linears = [m for m in self.model.layers.modules() if isinstance(m, Linear) and (
            (m.quantized is None and not stored_only)
            or (m.quantized is not None and any(is_wider_than_q4_0(s) for s in m.quantized.segments)))]
        if not linears:   # stored_only on a dense model (a GPU engine's): nothing to do, wherever it runs
            return Counter()
        self._check_q4_0("the decoder layers")
        if any(m.quantized is None and m.weight.shape[1] % 32 for m in linears):
            raise ValueError("an input size of the decoder layers is not a multiple of 32 (Q4_0's blocks)")
        replaced: Counter = Counter()
        for m in linears:
            quant = m.quantized
            if quant is None:
                new = QuantizedWeight([to_q4_0(m.weight)])
                replaced["plain"] += 1
            else:
                new = QuantizedWeight([to_q4_0(s) if is_wider_than_q4_0(s) else s for s in quant.segments])
                replaced.update(s.format for s in quant.segments if is_wider_than_q4_0(s))
            keep_quantized(m, new)
        return replaced

    def _check_q4_0(self, what: str) -> None:
        """Refuse a Q4_0 requantization where it cannot run: off the CPU, without the kernels, on a TP shard."""
        if self.model.norm.weight.device.type != "cpu" or kernels.load() is None:
            raise ValueError(f"requantizing {what} to Q4_0 needs the CPU and its C++ kernels")
        if self.tp is not None:
            raise ValueError("a tensor-parallel shard's weights are not requantized")
