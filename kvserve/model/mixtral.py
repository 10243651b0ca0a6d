"""Mixtral: Mistral's layers with a mixture-of-experts MLP (moe.py), the top-k routing weights renormalized. Its
checkpoints name the MLP block_sparse_moe and each expert's projections w1 (gate), w3 (up) and w2 (down)."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from kvserve.model.causal_lm import CausalLM
from kvserve.model.decoder import ModelSpec
from kvserve.model.llama import llama_spec
from kvserve.model.model_config import ModelConfig

_EXPERT = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|(gate))\.")
_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class MixtralForCausalLM(CausalLM):
    """Mixtral checkpoints (HF MixtralForCausalLM)."""

    @classmethod
    def declare(cls, cfg: ModelConfig) -> ModelSpec:
        return llama_spec(cfg)

    @classmethod
    def checkpoint_weights(cls, weights: Iterable[tuple[str, torch.Tensor]],
                           cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """block_sparse_moe.experts.{e}.w1/w3/w2 and block_sparse_moe.gate as the MoE families' names
        (mlp.experts.{e}.gate_proj/up_proj/down_proj, mlp.gate)."""
        for name, t in weights:
            yield _EXPERT.sub(_rename, name), t


def _rename(m: re.Match) -> str:
    if m.group(3):
        return ".mlp.gate."
    return f".mlp.experts.{m.group(1)}.{_PROJECTIONS[m.group(2)]}."
