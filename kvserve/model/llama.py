"""The Llama family: Llama, Mistral (a sliding window on every layer), Qwen2 (q|k|v bias; a window from
max_window_layers on where use_sliding_window is set), Qwen3 (q/k norm), and their mixtures of experts: Qwen2-MoE
(with a shared expert) and Qwen3-MoE, whose layers are these with an MoE MLP (moe.py; Mixtral: mixtral.py). Pre-norm
layers, SwiGLU, one RoPE table."""
from __future__ import annotations

from kvserve.model.causal_lm import CausalLM
from kvserve.model.decoder import LayerSpec, ModelSpec, RopeSpec, check_activation
from kvserve.model.model_config import SLIDING, ModelConfig
from kvserve.model.moe import moe_spec


def llama_spec(cfg: ModelConfig, qk_norm_whole: bool = False) -> ModelSpec:
    check_activation(cfg.hidden_act)
    types = cfg.layer_types or [None] * cfg.num_hidden_layers
    layers = tuple(LayerSpec(scale=cfg.head_dim ** -0.5, qk_norm=cfg.qk_norm, activation=cfg.hidden_act,
                             sliding_window=cfg.sliding_window if kind == SLIDING else None,
                             qk_norm_whole=qk_norm_whole, moe=moe_spec(cfg, i))
                   for i, kind in enumerate(types))
    return ModelSpec(layers, (RopeSpec(cfg.rope_theta, cfg.rope_scaling),))


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE checkpoints (ModelConfig's attention_bias,
    o_proj_bias, qk_norm and experts)."""

    @classmethod
    def declare(cls, cfg: ModelConfig) -> ModelSpec:
        return llama_spec(cfg)
