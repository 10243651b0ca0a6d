"""The causal LM around a family's decoder (kvserve/model/decoder.py): the output matrix and logits, the weights'
loading, tensor parallelism, and a speculative draft's cut and requantized heads."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from kvserve import kernels
from kvserve.model.decoder import DecoderModel, ModelSpec
from kvserve.model.layers import Linear, VocabEmbedding, PackedWeight, load_packed_weights, packed_linear, prepack_linears
from kvserve.model.model_config import ModelConfig
from kvserve.model.quantization import INT8, INT8_GROUP, QuantizedWeight, is_wider_than_q4_0, to_q4_0
from kvserve.module import InferenceModule


class CausalLM(InferenceModule):
    """Causal LM over one step's flattened tokens: forward -> hidden states, compute_logits -> float32 logits. A
    family subclasses it with its declaration (declare) and, where its checkpoints need it, its weight names."""

    # HF checkpoint projection name -> (our fused module, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    @classmethod
    def declare(cls, cfg: ModelConfig) -> ModelSpec:
        """The family's layers for this config (kvserve/model/decoder.py)."""
        raise NotImplementedError

    @classmethod
    def checkpoint_weights(cls, weights: Iterable[tuple[str, torch.Tensor]],
                           cfg: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the HF names of the Llama layout (q_proj, ..., gate_proj, up_proj), as the
        loader reads them, before a tensor-parallel rank takes its slices: where a family's checkpoints store them
        otherwise (Phi-3's fused projections), it renames or splits them here."""
        return weights

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.declare(cfg))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        # tied embeddings: packed by prepack(), or the quantized table itself (load_weights)
        self.packed_lm_head: PackedWeight | None = None
        self.cut_lm_head: Linear | None = None   # the output matrix's first rows (restrict_vocab)
        # restrict_vocab: a dense output matrix's plain rows, kept for row_logits after prepack() releases them
        self._plain_head: torch.Tensor | None = None
        self._rows_head: tuple[tuple[int, ...], Linear, torch.Tensor | None] | None = None   # row_logits' last
        self.tp = None   # tensor parallelism: the group that gathers the ranks' vocabulary slices of the logits
        self.tp_vocab = (cfg.vocab_size, cfg.vocab_size)   # (columns per rank, whole vocabulary)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        """input_ids, positions: [T] over all sequences of the step -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, cut: bool = False) -> torch.Tensor | None:
        """hidden [N, hidden] (only the rows that sample) -> float32 logits [N, vocab]; cut: [N, n] from the first
        n rows of the output matrix (restrict_vocab's). Tensor-parallel: every rank calls it with the same rows;
        rank 0 gets the logits, the others None."""
        if cut:
            if self.cut_lm_head is None:
                raise ValueError("compute_logits(cut=True) before restrict_vocab")
            return self._capped(self.cut_lm_head(hidden).float())
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif self.packed_lm_head is not None:
            logits = packed_linear(hidden, self.packed_lm_head).float()
        else:
            logits = torch.nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        logits = self._capped(logits)
        return logits if self.tp is None else self.tp.gather_columns(logits, *self.tp_vocab)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The declared final soft-cap (Gemma 2), in transformers' order of operations."""
        cap = self.model.spec.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

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

    def set_tensor_parallel(self, comm, vocab_start: int, vocab_per_rank: int, vocab_size: int) -> None:
        """Make this rank's shard (built from ShardPlan.local_config, loaded through shard_weights) one part of the
        group: o and down are row-parallel, the embedding and head vocab-parallel (kvserve/distributed/plan.py)."""
        for layer in self.model.layers:
            layer.self_attn.o_proj.tp = comm
            layer.mlp.down_proj.tp = comm
        self.model.embed_tokens.tp = comm
        self.model.embed_tokens.vocab_start = vocab_start
        self.tp = comm
        self.tp_vocab = (vocab_per_rank, vocab_size)

    def prepack(self, release: bool = False) -> int:
        """Pack the matmul weights for the CPU's bf16 kernels (after loading; no-op elsewhere); release: drop each
        plain weight as its pack is made (prepack_linears)."""
        embed = self.model.embed_tokens
        tied = [embed.weight] if self.lm_head is None and embed.quantized is None else []
        num, extra = prepack_linears(self, tied, release=release)
        if extra:
            self.packed_lm_head = extra[0]
        return num

    def _output_matrix(self) -> Linear | VocabEmbedding:
        """The module whose rows give the logits: the head, or the embedding table of a tied model."""
        return self.lm_head if self.lm_head is not None else self.model.embed_tokens

    def _quantized_head(self, quant: QuantizedWeight, dtype: torch.dtype) -> Linear:
        """A head that multiplies `quant`; its weight is shape-only."""
        n, k = quant.out_features, self.config.hidden_size
        head = Linear(k, n)
        head.packed = PackedWeight(n, quant=quant)
        head.weight = nn.Parameter(torch.empty(n, k, dtype=dtype, device="meta"), requires_grad=False)
        return head

    def _set_quantized_head(self, quant: QuantizedWeight, dtype: torch.dtype) -> None:
        """A head of its own (untying a tied model's) that multiplies `quant`."""
        self.lm_head = self._quantized_head(quant, dtype)
        self.packed_lm_head = None

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
            self._plain_head = src.weight
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
            m.packed = PackedWeight(new.out_features, quant=new)
            m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=m.weight.dtype, device="meta"),
                                    requires_grad=False)
        return replaced

    def _check_q4_0(self, what: str) -> None:
        """Refuse a Q4_0 requantization where it cannot run: off the CPU, without the kernels, on a TP shard."""
        if self.model.norm.weight.device.type != "cpu" or kernels.load() is None:
            raise ValueError(f"requantizing {what} to Q4_0 needs the CPU and its C++ kernels")
        if self.tp is not None:
            raise ValueError("a tensor-parallel shard's weights are not requantized")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; unknown or missing names raise ModelLoadError."""
        self.cut_lm_head = self._plain_head = self._rows_head = None   # a cut of the old output matrix
        for m in self.modules():
            if isinstance(m, (Linear, VocabEmbedding)) and m.weight.is_meta:   # released or quantized: storage again
                m.weight = torch.nn.Parameter(torch.empty(m.weight.shape, dtype=m.weight.dtype), requires_grad=False)
            if isinstance(m, Linear):   # packed copies of the old weights are stale now
                m.packed = None
            elif isinstance(m, VocabEmbedding):
                m.quantized = None
        self.packed_lm_head = None
        load_packed_weights(self, self.adapt_weights(weights), self.packed_modules, self._skip)
        embed = self.model.embed_tokens
        if self.lm_head is None and embed.quantized is not None:   # tied: the quantized table is the head's pack
            self.packed_lm_head = PackedWeight(embed.weight.shape[0], quant=embed.quantized)

    def adapt_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's HF-named tensors as the modules take them (a family may rewrite some)."""
        return weights

    def _skip(self, name: str) -> bool:
        # tied checkpoints may still carry lm_head.weight; old ones carry the rotary inv_freq buffer
        return name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")
