"""Gemma 3 (text): sliding-window (local) layers interleaved with global ones, each kind on its own RoPE base; q/k
norm; GeGLU; sandwich norms; embeddings scaled by sqrt(hidden_size); every RMSNorm multiplies by (1 + weight)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvserve.model.causal_lm import CausalLM
from kvserve.model.decoder import LayerSpec, ModelSpec, RopeSpec, check_activation
from kvserve.model.model_config import SLIDING, ModelConfig

DEFAULT_LOCAL_THETA = 10000.0   # HF's rope_local_base_freq default
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256


def gemma3_spec(cfg: ModelConfig) -> ModelSpec:
    check_activation(cfg.hidden_act)
    types = cfg.layer_types or [None] * cfg.num_hidden_layers
    scale = float(cfg.query_pre_attn_scalar or DEFAULT_QUERY_PRE_ATTN_SCALAR) ** -0.5
    ropes = (RopeSpec(cfg.rope_theta, cfg.rope_scaling), RopeSpec(cfg.rope_local_theta or DEFAULT_LOCAL_THETA))
    layers = tuple(LayerSpec(scale=scale, rope=1 if kind == SLIDING else 0, qk_norm=True, activation=cfg.hidden_act,
                             sandwich_norms=True, sliding_window=cfg.sliding_window if kind == SLIDING else None,
                             softcap=cfg.attn_logit_softcapping)
                   for kind in types)
    return ModelSpec(layers, ropes, embed_scale=cfg.hidden_size ** 0.5, final_softcap=cfg.final_logit_softcapping)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text checkpoints (HF Gemma3ForCausalLM, GGUF gemma3); the embedding is the output matrix."""

    @classmethod
    def declare(cls, cfg: ModelConfig) -> ModelSpec:
        return gemma3_spec(cfg)

    def adapt_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF stores each norm's weight w and multiplies by 1 + w: the modules hold 1 + w (the same float32 sum)."""
        for name, tensor in weights:
            yield (name, tensor.float() + 1.0) if name.endswith("norm.weight") else (name, tensor)
