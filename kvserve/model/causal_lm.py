"""The causal LM around a family's decoder (kvserve/model/decoder.py): the output matrix and logits, the weights'
loading, tensor parallelism (a speculative draft's cut and requantized heads: draft_heads.py)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from kvserve.model.decoder import DecoderModel, ModelSpec
from kvserve.model.linear_roles import DECODER_LINEARS
from kvserve.model.layers import Linear, VocabEmbedding, load_packed_weights, prepack_linears
from kvserve.model.linear_method import DENSE, LinearMethod, PackedBf16Method, shape_only
from kvserve.model.model_config import ModelConfig
from kvserve.model.moe import SparseMoE
from kvserve.module import InferenceModule
from kvserve.model.draft_heads import DraftHeads


class CausalLM(DraftHeads, InferenceModule):
    """Causal LM over one step's flattened tokens: forward -> hidden states, compute_logits -> float32 logits. A
    family subclasses it with its declaration (declare) and, where its checkpoints need it, its weight names."""

    # HF checkpoint projection name -> (our fused module, shard id), from the decoder's declared linears
    packed_modules = {p.checkpoint: (r.name, p.shard) for r in DECODER_LINEARS for p in r.projections if p.shard}

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
        # tied embeddings: the method that multiplies the embedding table as the head (packed by prepack(), or the
        # quantized table's own, load_weights)
        self.tied_head: LinearMethod = DENSE
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
        else:
            logits = self.tied_head.apply(self.model.embed_tokens, hidden).float()
        logits = self._capped(logits)
        return logits if self.tp is None else self.tp.gather_columns(logits, *self.tp_vocab)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The declared final soft-cap (Gemma 2), in transformers' order of operations."""
        cap = self.model.spec.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def set_tensor_parallel(self, comm, vocab_start: int, vocab_per_rank: int, vocab_size: int) -> None:
        """Make this rank's shard (built from ShardPlan.local_config, loaded through shard_weights) one part of the
        group: o and down are row-parallel, the embedding and head vocab-parallel (kvserve/distributed/plan.py)."""
        for layer in self.model.layers:
            for role in DECODER_LINEARS:
                if role.row_parallel and role.held_by(layer):
                    role.of(layer).tp = comm
            if isinstance(layer.mlp, SparseMoE):   # its experts' partial sums are reduced once, weighted
                layer.mlp.tp = comm
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
            self.tied_head = extra[0]
            if isinstance(extra[0], PackedBf16Method):
                embed.method = extra[0]   # the lookups read the head's pack: one copy of the table
                if release:
                    shape_only(embed)
        return num

    def _output_matrix(self) -> Linear | VocabEmbedding:
        """The module whose rows give the logits: the head, or the embedding table of a tied model."""
        return self.lm_head if self.lm_head is not None else self.model.embed_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; unknown or missing names raise ModelLoadError."""
        self.cut_lm_head = self._plain_head = self._rows_head = None   # a cut of the old output matrix
        for m in self.modules():
            if isinstance(m, (Linear, VocabEmbedding)) and m.weight.is_meta:   # released or quantized: storage again
                m.weight = torch.nn.Parameter(torch.empty(m.weight.shape, dtype=m.weight.dtype), requires_grad=False)
            if isinstance(m, (Linear, VocabEmbedding)):   # packed copies of the old weights are stale now
                m.method = DENSE
        self.tied_head = DENSE
        load_packed_weights(self, self.adapt_weights(weights), self.packed_modules, self._skip)
        embed = self.model.embed_tokens
        if self.lm_head is None and embed.quantized is not None:   # tied: the quantized table is the head's
            self.tied_head = embed.method

    def adapt_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's HF-named tensors as the modules take them (a family may rewrite some)."""
        return weights

    def _skip(self, name: str) -> bool:
        # tied checkpoints may still carry lm_head.weight; old ones carry the rotary inv_freq buffer
        return name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")
