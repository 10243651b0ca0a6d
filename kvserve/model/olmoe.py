"""OLMoE: Llama-shaped layers with a mixture-of-experts MLP (moe.py) and an RMSNorm over the whole q and k
projections (not per head) before RoPE."""
from __future__ import annotations

from kvserve.errors import ModelLoadError
from kvserve.model.causal_lm import CausalLM
from kvserve.model.decoder import ModelSpec
from kvserve.model.llama import llama_spec
from kvserve.model.model_config import ModelConfig


class OlmoeForCausalLM(CausalLM):
    """OLMoE checkpoints (HF OlmoeForCausalLM)."""

    @classmethod
    def declare(cls, cfg: ModelConfig) -> ModelSpec:
        if cfg.clip_qkv is not None:
            raise ModelLoadError(f"clip_qkv {cfg.clip_qkv} is not supported (q, k and v are never clipped)")
        return llama_spec(cfg, qk_norm_whole=True)
