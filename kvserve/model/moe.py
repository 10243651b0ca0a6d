"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router scores the experts for every token,
the token runs its top-k experts' gated MLPs, and their outputs are summed with the routing weights; Qwen2-MoE adds a
shared expert that every token runs, scaled by a sigmoid gate.

A step's tokens are grouped by expert once per layer (one stable sort of every token's k choices). Each expert that
some token chose then runs once over its group, through its linears' methods (packed bf16, oneDNN, GGUF or int8
blocks: the dense models' kernels), and its rows are added back into their tokens' rows times the routing weights,
experts in increasing order (transformers' order of the sum). An expert no token chose costs nothing: a decode step
reads only the chosen experts' weights.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.model.layers import Linear
from kvserve.model.model_config import ModelConfig
from kvserve.module import InferenceModule


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer's shape and routing."""
    num_experts: int
    top_k: int
    intermediate_size: int             # each expert's
    renormalize: bool                  # the top-k weights divided by their sum (else the softmax's own)
    shared_intermediate_size: int = 0  # > 0: a shared expert gated by sigmoid(x . w) (Qwen2-MoE)

    def describe(self) -> str:
        shared = f" + a shared expert of {self.shared_intermediate_size}" if self.shared_intermediate_size else ""
        return f"{self.num_experts} experts of {self.intermediate_size}, top-{self.top_k}{shared}"


def moe_spec(cfg: ModelConfig, layer: int) -> MoESpec | None:
    """Layer `layer`'s MoE as the config declares it, or None for a dense MLP."""
    if not cfg.num_experts or (cfg.moe_layers is not None and layer not in cfg.moe_layers):
        return None
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ModelLoadError(f"num_experts_per_tok {cfg.num_experts_per_tok} must be between 1 and num_experts "
                             f"{cfg.num_experts}")
    return MoESpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size or cfg.intermediate_size,
                   cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)


class SparseMoE(InferenceModule):
    """Router (`gate`), experts (each the dense models' gated MLP) and the optional shared expert, under the
    checkpoints' names (mlp.gate, mlp.experts.{e}.gate_proj/up_proj/down_proj, mlp.shared_expert[_gate])."""

    def __init__(self, cfg: ModelConfig, spec: MoESpec, make_mlp):
        super().__init__()
        self.spec = spec
        self.gate = Linear(cfg.hidden_size, spec.num_experts)
        self.gate.keep_dense = True   # the experts chosen at the checkpoint's precision under int8 too
        self.experts = nn.ModuleList(make_mlp(spec.intermediate_size) for _ in range(spec.num_experts))
        shared = spec.shared_intermediate_size
        self.shared_expert = make_mlp(shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1) if shared else None
        if shared:
            self.shared_expert_gate.keep_dense = True
        # tensor parallelism: the group that sums the ranks' partial outputs (each rank holds a slice of every
        # expert's intermediate size, and computes the same routing from its whole router)
        self.tp = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (routing weights [T, k] float32, expert ids [T, k]): the softmax over all experts in
        float32, its top k, renormalized where the family does."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        flat_weights = weights.view(-1)
        for expert, tokens, choices in expert_groups(ids, self.spec.num_experts):
            y = self.experts[expert](x.index_select(0, tokens))
            out.index_add_(0, tokens, y.float() * flat_weights.index_select(0, choices).unsqueeze(1))
        if self.shared_expert is not None:
            out += (torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)).float()
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out.to(x.dtype)


def expert_groups(ids: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """ids [T, k] (each token's chosen experts) -> (expert, its tokens, their choices' flat indices into [T * k]) for
    every expert some token chose, in increasing order; one sort for the whole step."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, n in enumerate(counts):
        if n:
            choices = order[start:start + n]
            yield expert, choices // k, choices
        start += n


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    """The model's MoE blocks."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def describe_moe(model: nn.Module, weight_bytes) -> str | None:
    """What the log says of a model's experts: their shape, and the bytes of weights a token reads (every weight
    but the experts its router did not choose), or None for a dense model. weight_bytes(module) -> bytes."""
    blocks = moe_layers(model)
    if not blocks:
        return None
    total = weight_bytes(model)
    idle = sum(weight_bytes(b.experts[0]) * (b.spec.num_experts - b.spec.top_k) for b in blocks)
    shapes = sorted({b.spec.describe() for b in blocks})
    return (f"mixture of experts in {len(blocks)} layers ({'; '.join(shapes)}): {(total - idle) / 2**30:.2f} of "
            f"{total / 2**30:.2f} GiB of weights read per token")
