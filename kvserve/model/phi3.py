"""Phi-3 (Phi-3-mini, Phi-3-medium, Phi-3.5-mini's shape): Llama's layers with the q|k|v and gate|up projections
stored fused in the checkpoint, and a sliding window on every layer where config.json sets one. longrope scaling
(the 128k-context checkpoints) and partial rotary factors are refused at load."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.causal_lm import CausalLM
from kvserve.model.llama import llama_spec
from kvserve.model.decoder import ModelSpec
from kvserve.model.model_config import ModelConfig
from kvserve.model.quantization import QuantizedTensor


def _rows(t, start: int, stop: int):
    """Rows [start, stop) of a checkpoint matrix, dense or quantized (a GGUF row is blocks of its own)."""
    return replace(t, data=t.data[start:stop]) if isinstance(t, QuantizedTensor) else t[start:stop]


class Phi3ForCausalLM(CausalLM):
    """Phi-3 checkpoints (HF Phi3ForCausalLM)."""

    @classmethod
    def declare(cls, cfg: ModelConfig) -> ModelSpec:
        return llama_spec(cfg)

    @classmethod
    def checkpoint_weights(cls, weights: Iterable[tuple[str, torch.Tensor]],
                           cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused qkv_proj and gate_up_proj tensors as Llama's q/k/v and gate/up ones, so that everything that
        reads HF names (the tensor-parallel split, int8 quantization, the loaders' fusing) sees one layout."""
        q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
            cfg.intermediate_size
        for name, t in weights:
            stem, _, kind = name.rpartition(".")
            if stem.endswith("self_attn.qkv_proj"):
                base = stem.removesuffix("qkv_proj")
                if t.shape[0] != q + 2 * kv:
                    raise ModelLoadError(f"{name} has {t.shape[0]} rows; q, k and v need {q + 2 * kv}")
                yield f"{base}q_proj.{kind}", _rows(t, 0, q)
                yield f"{base}k_proj.{kind}", _rows(t, q, q + kv)
                yield f"{base}v_proj.{kind}", _rows(t, q + kv, q + 2 * kv)
            elif stem.endswith("mlp.gate_up_proj"):
                base = stem.removesuffix("gate_up_proj")
                if t.shape[0] != 2 * inter:
                    raise ModelLoadError(f"{name} has {t.shape[0]} rows; gate and up need {2 * inter}")
                yield f"{base}gate_proj.{kind}", _rows(t, 0, inter)
                yield f"{base}up_proj.{kind}", _rows(t, inter, 2 * inter)
            else:
                yield name, t
