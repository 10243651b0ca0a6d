"""Gemma 2: Gemma 3's layers (sandwich norms, GeGLU, scaled embeddings, norms holding 1 + w) without q/k norm, one
RoPE table, every other layer local (sliding window), attention scores and final logits soft-capped."""
from __future__ import annotations

from kvserve.model.decoder import LayerSpec, ModelSpec, RopeSpec, check_activation
from kvserve.model.gemma3 import DEFAULT_QUERY_PRE_ATTN_SCALAR, Gemma3ForCausalLM
from kvserve.model.model_config import SLIDING, ModelConfig


def gemma2_spec(cfg: ModelConfig) -> ModelSpec:
    check_activation(cfg.hidden_act)
    types = cfg.layer_types or [None] * cfg.num_hidden_layers
    scale = float(cfg.query_pre_attn_scalar or DEFAULT_QUERY_PRE_ATTN_SCALAR) ** -0.5
    layers = tuple(LayerSpec(scale=scale, activation=cfg.hidden_act, sandwich_norms=True,
                             sliding_window=cfg.sliding_window if kind == SLIDING else None,
                             softcap=cfg.attn_logit_softcapping) for kind in types)
    return ModelSpec(layers, (RopeSpec(cfg.rope_theta, cfg.rope_scaling),), embed_scale=cfg.hidden_size ** 0.5,
                     final_softcap=cfg.final_logit_softcapping)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 checkpoints (HF Gemma2ForCausalLM, GGUF gemma2); Gemma 3's weight layout."""

    @classmethod
    def declare(cls, cfg: ModelConfig) -> ModelSpec:
        return gemma2_spec(cfg)
