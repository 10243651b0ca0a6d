"""ModelConfig: the shape of a decoder-only checkpoint, read from HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvserve.errors import ModelLoadError

# GGUF general.architecture -> HF architecture name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ROPE_TYPES = ("default", "linear", "llama3", "gguf_freq_factors")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    """Everything the model code needs to build a decoder; field names follow HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False      # bias on q/k/v (Qwen2 always, Llama/Qwen3 when attention_bias)
    o_proj_bias: bool = False         # Llama/Qwen3 put attention_bias on o_proj too; Qwen2 does not
    mlp_bias: bool = False
    qk_norm: bool = False             # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: torch.dtype | None = None   # the checkpoint's dtype; None for quantized GGUF

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids as a list (config.json allows an int or a list)."""
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json (transformers 4.x or 5.x layout)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json has no 'architectures' entry; cannot tell which model to build")
        arch = archs[0]
        try:
            hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
            return cls._from_hf_fields(arch, cfg, hidden, heads)
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from None

    @classmethod
    def _from_hf_fields(cls, arch: str, cfg: dict, hidden: int, heads: int) -> ModelConfig:
        _check_activation(cfg.get("hidden_act", "silu"))
        rope_theta, rope_scaling = _hf_rope(cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_hf_context_length(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else bias,
            o_proj_bias=False if is_qwen2 else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            torch_dtype=_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "")),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, vocab_rows: int, has_output: bool,
                           rope_freq_factors: list[float] | None = None) -> ModelConfig:
        """Build from GGUF key/value metadata; `vocab_rows` is token_embd's row count."""
        arch_key = meta.get("general.architecture")
        if arch_key not in GGUF_ARCHITECTURES:
            raise ModelLoadError(f"GGUF architecture {arch_key!r} is not supported; "
                                 f"supported: {sorted(GGUF_ARCHITECTURES)}")
        try:
            return cls._from_gguf_fields(arch_key, meta, vocab_rows, has_output, rope_freq_factors)
        except KeyError as e:
            raise ModelLoadError(f"GGUF metadata is missing required key {e.args[0]!r}") from None

    @classmethod
    def _from_gguf_fields(cls, a: str, meta: dict, vocab_rows: int, has_output: bool,
                          rope_freq_factors: list[float] | None) -> ModelConfig:
        hidden = int(meta[f"{a}.embedding_length"])
        heads = int(meta[f"{a}.attention.head_count"])
        return cls(
            architecture=GGUF_ARCHITECTURES[a],
            vocab_size=int(meta.get(f"{a}.vocab_size", vocab_rows)),
            hidden_size=hidden,
            intermediate_size=int(meta[f"{a}.feed_forward_length"]),
            num_hidden_layers=int(meta[f"{a}.block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(a, meta, rope_freq_factors),
            max_position_embeddings=int(meta[f"{a}.context_length"]),
            tie_word_embeddings=not has_output,
            attention_bias=a == "qwen2",
            qk_norm=a == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=_gguf_eos_ids(meta),
        )


def _check_activation(act: str) -> None:
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"hidden_act {act!r} is not supported; only silu (SwiGLU) models are")


def _hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = params or dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported; supported: llama3, linear")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    return theta, scaling


def _hf_context_length(cfg: dict) -> int:
    length = int(cfg.get("max_position_embeddings", 2048))
    # no sliding-window attention kernel: serving past the window would silently differ from the
    # reference, so the context is capped at the window instead (Mistral v0.1, Qwen2 with use_sliding_window)
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", True)
    if window and uses_window and window < length:
        return int(window)
    return length


def _gguf_rope(a: str, meta: dict, freq_factors: list[float] | None) -> dict | None:
    kind = meta.get(f"{a}.rope.scaling.type", "none")
    if freq_factors is not None:
        # llama.cpp bakes llama3 scaling into a rope_freqs tensor: inv_freq is divided by it
        return {"rope_type": "gguf_freq_factors", "freq_factors": list(freq_factors)}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{a}.rope.scaling.factor"])}
    if kind not in ("none", ""):
        raise ModelLoadError(f"GGUF rope scaling type {kind!r} is not supported; supported: linear, llama3")
    return None


def _gguf_eos_ids(meta: dict) -> int | list[int] | None:
    ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    ids = list(dict.fromkeys(int(i) for i in ids))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids
