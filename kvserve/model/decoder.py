"""The decoder every family is built from, and the declaration a family makes of its layers.

A family (llama.py, gemma3.py, ...) declares each layer: its attention (scale, sliding window, q/k norm, which RoPE
table), its MLP's activation, its norms (pre-norm, or Gemma's sandwich of norms around attention and MLP); and the
model's embedding scale and logit soft-cap. The modules below build themselves from that declaration, with the
same names for the same roles in every family (self_attn.qkv_proj, o_proj, mlp.gate_up_proj, down_proj), so the
weight loaders, LoRA, tensor parallelism and the fused C++ stack (fused.py) serve every family that declares.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvserve.attention import Attention
from kvserve.errors import ModelLoadError
from kvserve.model.fused import FusedLayers, binding_key, build_fused_layers, is_same_binding, why_not_fused
from kvserve.model.layers import (GeluTanhAndMul, Linear, MergedLinear, RMSNorm, SiluAndMul, VocabEmbedding,
                                  apply_rotary, qk_norm_inplace, rotate_heads_inplace)
from kvserve.model.model_config import ModelConfig
from kvserve.model.moe import MoESpec, SparseMoE
from kvserve.model.rotary import RotaryEmbedding
from kvserve.module import InferenceModule

ACTIVATIONS = {"silu": SiluAndMul, "swish": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: its base and scaling (HF rope_scaling) over head_dim."""
    theta: float
    scaling: dict | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer computes."""
    scale: float                       # attention scores = scale * q . k
    rope: int = 0                      # index into ModelSpec.ropes
    sliding_window: int | None = None  # a token sees the last W keys up to its own; None: every earlier key
    qk_norm: bool = False              # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    activation: str = "silu"           # the MLP's gate activation (ACTIVATIONS)
    sandwich_norms: bool = False       # Gemma: a norm after attention and around the MLP as well
    softcap: float | None = None       # scaled scores s become softcap * tanh(s / softcap) (Gemma 2)
    qk_norm_whole: bool = False        # the q/k norm over the whole q and k projections, not per head (OLMoE)
    moe: MoESpec | None = None         # the MLP a mixture of experts (moe.py); None: one dense gated MLP


@dataclass(frozen=True)
class ModelSpec:
    """A model's layers as its family declares them."""
    layers: tuple[LayerSpec, ...]
    ropes: tuple[RopeSpec, ...]
    embed_scale: float | None = None   # embeddings times this (Gemma: sqrt(hidden_size)), in the model's dtype
    final_softcap: float | None = None   # logits become cap * tanh(logits / cap) (Gemma 2)

    def describe(self) -> str:
        """What the log says about the layers: windows, norms, activation."""
        windows = sorted({s.sliding_window for s in self.layers if s.sliding_window})
        parts = [f"{len(self.layers)} layers"]
        if windows:
            local = sum(1 for s in self.layers if s.sliding_window)
            parts.append(f"{local} with a sliding window of {'/'.join(map(str, windows))} tokens")
        acts = sorted({s.activation for s in self.layers})
        parts.append("activation " + "/".join(acts))
        if any(s.qk_norm for s in self.layers):
            parts.append("q/k norm")
        if any(s.qk_norm_whole for s in self.layers):
            parts.append("q/k norm over the whole projections")
        if any(s.sandwich_norms for s in self.layers):
            parts.append("sandwich norms")
        moe = sorted({s.moe.describe() for s in self.layers if s.moe})
        if moe:
            parts.append(f"{sum(1 for s in self.layers if s.moe)} MoE layers ({'; '.join(moe)})")
        caps = sorted({s.softcap for s in self.layers if s.softcap})
        if caps or self.final_softcap:
            parts.append(f"soft-capped attention {'/'.join(f'{c:g}' for c in caps) or '-'} and logits "
                         f"{self.final_softcap or '-'}")
        return ", ".join(parts)


def check_activation(act: str) -> None:
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"hidden_act {act!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}")


class DecoderAttention(InferenceModule):
    """Self-attention: fused qkv projection, optional per-head q/k norm, RoPE, paged attention, o_proj."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": h * d, "k": hkv * d, "v": hkv * d},   # linear_roles.py
                                     bias=cfg.attention_bias)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.whole_qk_norm = spec.qk_norm_whole
        self.q_norm = RMSNorm(h * d if spec.qk_norm_whole else d, cfg.rms_norm_eps) \
            if spec.qk_norm or spec.qk_norm_whole else None
        self.k_norm = RMSNorm(hkv * d if spec.qk_norm_whole else d, cfg.rms_norm_eps) \
            if spec.qk_norm or spec.qk_norm_whole else None
        self.attn = Attention(h, d, spec.scale, hkv, spec.sliding_window, spec.softcap)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.whole_qk_norm:   # q and k each normalized as one row, then rotated
            q, k, v = self.qkv_proj.split(qkv)
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
            q, k = apply_rotary(q.view(-1, h, d), cos, sin), apply_rotary(k.view(-1, hkv, d), cos, sin)
            return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v.contiguous(), attn_metadata))
        normed = self.q_norm is None or qk_norm_inplace(qkv, self.q_norm, self.k_norm, h, hkv, d)
        if normed and rotate_heads_inplace(qkv, h + hkv, d, cos, sin):
            # q and k normalized and rotated in place inside qkv (the fused stack's kernels, in its order); the
            # backends take the strided q/k/v views as they are
            q, k, v = self.qkv_proj.split(qkv)
            return self.o_proj(self.attn(q, k, v, attn_metadata))
        q, k, v = self.qkv_proj.split(qkv)
        if not normed:   # a row per head (contiguous: the norm's one-kernel path takes it), then RoPE
            q = self.q_norm(q.reshape(-1, d)).view(-1, h * d)
            k = self.k_norm(k.reshape(-1, d)).view(-1, hkv * d)
            if rotate_heads_inplace(q, h, d, cos, sin):
                if not rotate_heads_inplace(k, hkv, d, cos, sin):   # (q and k take the same paths)
                    k = apply_rotary(k.view(-1, hkv, d), cos, sin).flatten(1)
                return self.o_proj(self.attn(q, k, v, attn_metadata))
        q, k = apply_rotary(q.reshape(-1, h, d), cos, sin), apply_rotary(k.reshape(-1, hkv, d), cos, sin)
        out = self.attn(q.flatten(1), k.flatten(1), v.contiguous(), attn_metadata)
        return self.o_proj(out)


class DecoderMLP(InferenceModule):
    """Gated feed-forward (SwiGLU, GeGLU) with one fused gate|up matmul; also each expert of an MoE (moe.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool):
        super().__init__()
        i = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": i, "up": i}, bias=bias)
        self.down_proj = Linear(i, hidden_size, bias=bias)
        self.act_fn = ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(InferenceModule):
    """Residual block. Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)) (post_attention_layernorm is the MLP's
    norm). Sandwich (Gemma): x + norm(attn(norm(x))), then x + norm(mlp(norm(x))) (post_attention_layernorm follows
    attention; pre_ and post_feedforward_layernorm wrap the MLP)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = DecoderAttention(cfg, spec)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps) if spec.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(h, eps) if spec.sandwich_norms else None
        mlp = lambda size: DecoderMLP(h, size, spec.activation, cfg.mlp_bias)   # noqa: E731
        self.mlp = mlp(cfg.intermediate_size) if spec.moe is None else SparseMoE(cfg, spec.moe, mlp, spec.activation)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (last output, residual stream before it); the adds are fused into the norms."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, attn_metadata)
        if self.pre_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class DecoderModel(InferenceModule):
    """Embedding, decoder layers and final norm; one RoPE table per kind the layers declare."""

    def __init__(self, cfg: ModelConfig, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, s) for s in spec.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_embs = nn.ModuleList(RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, r.theta,
                                                         r.scaling) for r in spec.ropes)
        self.use_fused_layers = True   # the one-call C++ layer stack where it applies (kvserve/model/fused.py)
        self.split_decode_batches = True   # in it, big decode batches shared out between the threads
        self._fused: FusedLayers | None = None
        self._fused_refused: tuple | None = None   # the binding on which the fused stack did not apply

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The first (for most families the only) RoPE table."""
        return self.rotary_embs[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.spec.embed_scale is not None:
            hidden = hidden * torch.tensor(self.spec.embed_scale, dtype=hidden.dtype)
        tables = [rope(positions, hidden.dtype) for rope in self.rotary_embs]
        residual = None
        # the step that calibrates FP8 KV scales runs the modules, whose Attention sets them (kvserve/attention/fp8.py)
        calibrating = self.layers and self.layers[0].self_attn.attn.calibrate_kv_scales
        fused = self._fused_layers() if hidden.dtype == torch.bfloat16 and hidden.is_cpu and not calibrating else None
        if fused is not None:
            hidden, residual = fused.forward(hidden, tables, attn_metadata, self.split_decode_batches)
        else:
            for layer in self.layers:
                cos, sin = tables[layer.spec.rope]
                hidden, residual = layer(hidden, residual, cos, sin, attn_metadata)
        if residual is None:   # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def fused_status(self) -> str:
        """Whether the fused stack runs for this model as bound now, and if not which feature keeps it off."""
        reason = why_not_fused(self.layers) if self.use_fused_layers else "switched off"
        return "the fused C++ layer stack" if reason is None else f"the layer modules ({reason})"

    def moe_status(self) -> str | None:
        """How the MoE blocks run in bf16 on the CPU (moe.cpp's one call each, or the torch ops and why), or None
        for a model without them."""
        blocks = [layer.mlp for layer in self.layers if layer.spec.moe is not None]
        why = next((w for b in blocks if (w := b.kernel_refusal()) is not None), None)
        return None if not blocks else "one C++ call each" if why is None else f"the torch ops ({why})"

    def _fused_layers(self) -> FusedLayers | None:
        if not self.use_fused_layers or not self.layers:
            return None
        if self._fused is not None and self._fused.is_current(self.layers):
            return self._fused
        if self._fused_refused is not None and is_same_binding(self._fused_refused, self.layers):
            return None
        self._fused = build_fused_layers(self.layers)
        self._fused_refused = None if self._fused is not None else binding_key(self.layers)
        return self._fused
