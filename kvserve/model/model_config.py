"""ModelConfig: the shape of a decoder-only checkpoint, read from HF config.json or GGUF metadata."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.errors import ModelLoadError

# GGUF general.architecture -> HF architecture name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
# llama.cpp renormalizes the top-k routing weights of these (its build_moe_ffn's norm_w); Mixtral is "llama" there
_GGUF_MOE_RENORMALIZE = ("llama", "qwen3moe")
SLIDING, FULL = "sliding_attention", "full_attention"   # HF's layer_types
_GEMMA3_PATTERN = 6   # Gemma 3: every sixth layer is global (HF's and llama.cpp's default)
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
    hidden_act: str = "silu"          # the MLP's gate activation (silu, gelu_pytorch_tanh)
    sliding_window: int | None = None   # the window of the layers whose layer_types entry is sliding_attention
    layer_types: list[str] | None = None   # per layer: sliding_attention or full_attention (None: all full)
    rope_local_theta: float | None = None   # the sliding layers' RoPE base where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None   # attention scale = its -1/2 power (Gemma); None: head_dim's
    final_logit_softcapping: float | None = None   # logits = cap * tanh(logits / cap) (Gemma 2)
    attn_logit_softcapping: float | None = None    # the same on attention scores (Gemma 2)
    # mixture of experts (kvserve/model/moe.py): each MoE layer routes a token to num_experts_per_tok of num_experts
    num_experts: int = 0              # 0: every MLP dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None   # each expert's intermediate size
    norm_topk_prob: bool = False      # the top-k routing weights renormalized to sum to 1 (Mixtral always)
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: an expert every token runs, gated by a sigmoid
    moe_layers: list[int] | None = None   # the layers whose MLP is an MoE (None: all of them, with num_experts)
    clip_qkv: float | None = None     # OLMoE: q, k and v clamped to [-clip, clip] (refused: olmoe.py)
    # encoders (BERT: kvserve/model/bert.py)
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    # pooling (LLM.embed): the checkpoint's own, from its sentence-transformers files (loader.load_hf_config);
    # None: LAST for decoders
    pooling_type: str | None = None
    pooling_normalize: bool = True
    max_seq_length: int | None = None   # sentence-transformers' limit (sentence_bert_config.json): max_model_len's default

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
        rope_theta, rope_scaling, rope_local = _hf_rope(cfg)
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
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
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("qkv_bias", True)) if is_qwen2 else bias,   # (Qwen2-MoE's qkv_bias)
            o_proj_bias=False if is_qwen2 else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            torch_dtype=_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "")),
            hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
            sliding_window=cfg.get("sliding_window"),
            layer_types=_hf_layer_types(arch, cfg),
            rope_local_theta=rope_local,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            clip_qkv=cfg.get("clip_qkv"),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            type_vocab_size=int(cfg.get("type_vocab_size", 0)),
            **_hf_moe(arch, cfg),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, vocab_rows: int, has_output: bool,
                           rope_freq_factors: list[float] | None = None,
                           moe_layers: list[int] | None = None) -> ModelConfig:
        """Build from GGUF key/value metadata; `vocab_rows` is token_embd's row count, `moe_layers` the layers with
        a router tensor (blk.N.ffn_gate_inp)."""
        arch_key = meta.get("general.architecture")
        if arch_key not in GGUF_ARCHITECTURES:
            raise ModelLoadError(f"GGUF architecture {arch_key!r} is not supported; "
                                 f"supported: {sorted(GGUF_ARCHITECTURES)}")
        try:
            cfg = cls._from_gguf_fields(arch_key, meta, vocab_rows, has_output, rope_freq_factors)
            return dataclasses.replace(cfg, **_gguf_moe(arch_key, meta, cfg, moe_layers))
        except KeyError as e:
            raise ModelLoadError(f"GGUF metadata is missing required key {e.args[0]!r}") from None

    @classmethod
    def _from_gguf_fields(cls, a: str, meta: dict, vocab_rows: int, has_output: bool,
                          rope_freq_factors: list[float] | None) -> ModelConfig:
        hidden = int(meta[f"{a}.embedding_length"])
        heads = int(meta[f"{a}.attention.head_count"])
        layers = int(meta[f"{a}.block_count"])
        window = meta.get(f"{a}.attention.sliding_window")
        gemma3, gemma = a == "gemma3", a in ("gemma2", "gemma3")
        head_dim = int(meta.get(f"{a}.attention.key_length", hidden // heads))
        return cls(
            architecture=GGUF_ARCHITECTURES[a],
            vocab_size=int(meta.get(f"{a}.vocab_size", vocab_rows)),
            hidden_size=hidden,
            intermediate_size=int(meta[f"{a}.feed_forward_length"]),
            num_hidden_layers=int(meta[f"{a}.block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(a, meta, rope_freq_factors),
            max_position_embeddings=int(meta[f"{a}.context_length"]),
            tie_word_embeddings=not has_output,
            attention_bias=a in ("qwen2", "qwen2moe"),
            qk_norm=a in ("qwen3", "qwen3moe"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=_gguf_eos_ids(meta),
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            sliding_window=int(window) if window else None,
            # llama.cpp's Gemma graphs: every sixth layer global (Gemma 3, whose local layers take RoPE base 10000),
            # every other (Gemma 2)
            layer_types=_pattern(layers, _GEMMA3_PATTERN if gemma3 else 2) if gemma and window else None,
            rope_local_theta=10000.0 if gemma3 else None,
            # llama.cpp's Gemma attention scale: head_dim's, but hidden / heads' for the 27Bs (Gemma 3: 62 layers,
            # Gemma 2: 46)
            query_pre_attn_scalar=(hidden // heads if layers == (62 if gemma3 else 46) else head_dim) if gemma
            else None,
            attn_logit_softcapping=meta.get(f"{a}.attn_logit_softcapping"),
            final_logit_softcapping=meta.get(f"{a}.final_logit_softcapping"),
        )


def _hf_moe(arch: str, cfg: dict) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (Mixtral's num_local_experts; Qwen2/3-MoE's and OLMoE's
    num_experts, with Qwen's decoder_sparse_step and mlp_only_layers choosing the MoE layers); {} for a dense one."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not experts:
        return {}
    n = cfg["num_hidden_layers"]
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    mixtral = "num_local_experts" in cfg
    return dict(num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                moe_layers=[i for i in range(n) if i not in dense and (i + 1) % step == 0])


def _gguf_moe(a: str, meta: dict, cfg: ModelConfig, moe_layers: list[int] | None) -> dict[str, Any]:
    """The mixture-of-experts fields of a GGUF's metadata ({} for a dense model); a "llama" with experts is Mixtral."""
    experts = int(meta.get(f"{a}.expert_count") or 0)
    if not experts:
        return {}
    return dict(architecture="MixtralForCausalLM" if a == "llama" else cfg.architecture, num_experts=experts,
                num_experts_per_tok=int(meta[f"{a}.expert_used_count"]),
                moe_intermediate_size=int(meta.get(f"{a}.expert_feed_forward_length") or cfg.intermediate_size),
                norm_topk_prob=a in _GGUF_MOE_RENORMALIZE,
                shared_expert_intermediate_size=int(meta.get(f"{a}.expert_shared_feed_forward_length") or 0),
                moe_layers=moe_layers)


def _pattern(num_layers: int, every: int) -> list[str]:
    """Sliding layers with every `every`-th one full (Gemma 3's sliding_window_pattern)."""
    return [FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers)]


def _hf_layer_types(arch: str, cfg: dict) -> list[str] | None:
    """Which layers attend through the sliding window, as transformers decides: its own `layer_types` where
    config.json has them, else each family's rule (Mistral: all; Qwen2: with use_sliding_window, from
    max_window_layers on; Gemma 3: sliding_window_pattern)."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])[:n]
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise ModelLoadError(f"config.json's layer_types {cfg['layer_types']!r} is not one of "
                                 f"{SLIDING}/{FULL} per layer")
        return types if window and SLIDING in types else None
    if not window:
        return None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return [SLIDING] * n
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and cfg.get("use_sliding_window"):
        start = int(cfg.get("max_window_layers", n))
        return [SLIDING if i >= start else FULL for i in range(n)]
    if arch == "Gemma3ForCausalLM":
        return _pattern(n, int(cfg.get("sliding_window_pattern", _GEMMA3_PATTERN)))
    if arch == "Gemma2ForCausalLM":
        return _pattern(n, 2)   # every other layer local, the first one too
    return None


def _hf_rope(cfg: dict) -> tuple[float, dict | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' own base or None) from transformers 5 `rope_parameters`
    (one dict, or one per layer type) or 4.x `rope_theta`/`rope_scaling`/`rope_local_base_freq`."""
    params = dict(cfg.get("rope_parameters") or {})
    local = params.pop(SLIDING, None)
    params = dict(params.pop(FULL, None) or params)
    local_theta = cfg.get("rope_local_base_freq") if local is None else local.get("rope_theta")
    if local is not None and local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"rope scaling of the sliding layers ({local!r}) is not supported")
    theta, scaling = _hf_global_rope(cfg, params)
    return theta, scaling, None if local_theta is None else float(local_theta)


def _hf_global_rope(cfg: dict, params: dict) -> tuple[float, dict | None]:
    partial = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor {partial} is not supported: RoPE rotates every dimension")
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
