"""The Llama family: Llama, Mistral (a sliding window on every layer), Qwen2 (q|k|v bias; a window from
max_window_layers on where use_sliding_window is set), Qwen3 (q/k norm). Pre-norm layers, SwiGLU, one RoPE table."""
from __future__ import annotations

from kvserve.model.causal_lm import CausalLM
from kvserve.model.decoder import LayerSpec, ModelSpec, RopeSpec, check_activation
from kvserve.model.model_config import SLIDING, ModelConfig


def llama_spec(cfg: ModelConfig) -> ModelSpec:
    check_activation(cfg.hidden_act)
    types = cfg.layer_types or [None] * cfg.num_hidden_layers
    layers = tuple(LayerSpec(scale=cfg.head_dim ** -0.5, qk_norm=cfg.qk_norm, activation=cfg.hidden_act,
                             sliding_window=cfg.sliding_window if kind == SLIDING else None) for kind in types)
    return ModelSpec(layers, (RopeSpec(cfg.rope_theta, cfg.rope_scaling),))


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2 and Qwen3 checkpoints (ModelConfig's attention_bias, o_proj_bias, qk_norm)."""

    @classmethod
    def declare(cls, cfg: ModelConfig) -> ModelSpec:
        return llama_spec(cfg)
