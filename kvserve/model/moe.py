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

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kvserve import kernels
from kvserve.errors import ModelLoadError
from kvserve.model.fused import LinearDesc, linear_desc
from kvserve.model.layers import Linear
from kvserve.model.linear_method import invalidate_bindings, method_generation
from kvserve.model.model_config import ModelConfig
from kvserve.model.quantization import weight_bytes
from kvserve.module import InferenceModule

_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}   # layers.cpp's Activation
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class MoEDesc(ctypes.Structure):
    """moe.cpp's MoEDesc: one MoE block as its C++ kernel takes it (layout checked by a test)."""
    _fields_ = [("router", LinearDesc), ("experts", _p), ("shared_gate_up", LinearDesc), ("shared_down", LinearDesc),
                ("shared_gate", LinearDesc), ("num_experts", _i64), ("top_k", _i64), ("intermediate_size", _i64),
                ("shared_intermediate_size", _i64), ("renormalize", _i64), ("activation", _i64)]


def moe_struct_layout() -> list[int]:
    """The size and offsets moe.cpp's kvserve_moe_layout reports, from the ctypes mirror above."""
    return [ctypes.sizeof(MoEDesc), MoEDesc.experts.offset, MoEDesc.shared_gate.offset, MoEDesc.num_experts.offset,
            MoEDesc.activation.offset]


class MoEBinding:
    """A block's MoEDesc over its linears' methods as they are now (rebuilt when a method is replaced)."""

    def __init__(self, block: SparseMoE):
        spec = block.spec
        self.generation = method_generation()
        self.experts = (LinearDesc * (2 * spec.num_experts))(
            *(linear_desc(m) for e in block.experts for m in (e.gate_up_proj, e.down_proj)))
        shared = block.shared_expert
        shared_linears = [LinearDesc()] * 3 if shared is None else \
            [linear_desc(m) for m in (shared.gate_up_proj, shared.down_proj, block.shared_expert_gate)]
        self.desc = MoEDesc(linear_desc(block.gate), ctypes.addressof(self.experts), *shared_linears,
                            spec.num_experts, spec.top_k, spec.intermediate_size, spec.shared_intermediate_size,
                            int(spec.renormalize), _ACTIVATIONS[block.activation])
        self.ptr = ctypes.addressof(self.desc)


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

    def __init__(self, cfg: ModelConfig, spec: MoESpec, make_mlp, activation: str):
        super().__init__()
        self.spec, self.activation = spec, activation
        self._use_kernel = True
        self._binding: MoEBinding | None = None
        self._refusal: tuple = (None, None)   # (what it was checked on, kernel_refusal)
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

    @property
    def use_kernel(self) -> bool:
        """bf16 on the CPU: moe.cpp's one call (True), or the torch ops of forward (False)."""
        return self._use_kernel

    @use_kernel.setter
    def use_kernel(self, value: bool) -> None:
        self._use_kernel = bool(value)
        invalidate_bindings()   # a fused stack built with this block's descriptor is rebuilt

    def kernel_refusal(self) -> str | None:
        """Why moe.cpp's kernel does not run this block (bf16 on the CPU), or None; checked again when a linear's
        method is replaced."""
        key = (method_generation(), self.use_kernel, self.tp)
        if self._refusal[0] != key:
            self._refusal = (key, self._why_no_kernel())
        return self._refusal[1]

    def _why_no_kernel(self) -> str | None:
        lib = kernels.load()
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        checks = ((not self.use_kernel, "switched off"), (lib is None, "no C++ kernels"),
                  (lib is not None and not lib.silu_mul_fast, "no AVX2 or AVX-512 BF16 for its bf16 ops"),
                  (self.activation not in _ACTIVATIONS, f"activation {self.activation}"),
                  (self.tp is not None, "tensor parallelism (its ranks' sums are reduced in float32 by torch)"),
                  (any(m.method.kernel_weight() is None for m in linears),
                   "a linear without a packed bf16 or quantized weight"),
                  (any(m.bias is not None and m.bias.dtype != torch.bfloat16 for m in linears), "biases not in bf16"))
        return next((why for bad, why in checks if bad), None)

    def kernel_binding(self) -> MoEBinding:
        """The block's descriptor for moe.cpp as its linears are bound now (where kernel_refusal is None)."""
        if self._binding is None or self._binding.generation != method_generation():
            self._binding = MoEBinding(self)
        return self._binding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.is_cpu and self.use_kernel and self.kernel_refusal() is None:
            x = x.contiguous()
            out = torch.empty_like(x)
            if kernels.load().kvserve_moe_bf16(self.kernel_binding().ptr, x.data_ptr(), x.shape[0], x.shape[1],
                                               out.data_ptr()):
                raise RuntimeError("kvserve_moe_bf16 does not know the format or shape of a quantized weight of "
                                   "this MoE block (router, experts or shared expert)")
            return out
        weights, ids = self.route(x)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        flat_weights = weights.view(-1)
        for expert, tokens, choices in expert_groups(ids, self.spec.num_experts):
            y = self.experts[expert](x.index_select(0, tokens))
            out.index_add_(0, tokens, y.float() * flat_weights.index_select(0, choices).unsqueeze(1))
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x).float()) * self.shared_expert(x).float()
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


def describe_moe(model: nn.Module) -> str | None:
    """What the log says of a model's experts: their shape, and the bytes of weights a token reads (every weight
    but the experts its router did not choose), or None for a dense model."""
    blocks = moe_layers(model)
    if not blocks:
        return None
    total = weight_bytes(model)
    idle = sum(weight_bytes(b.experts[0]) * (b.spec.num_experts - b.spec.top_k) for b in blocks)
    shapes = sorted({b.spec.describe() for b in blocks})
    return (f"mixture of experts in {len(blocks)} layers ({'; '.join(shapes)}): {(total - idle) / 2**30:.2f} of "
            f"{total / 2**30:.2f} GiB of weights read per token")
