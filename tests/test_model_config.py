"""Model configs: HF config.json (transformers 4.x and 5.x layouts) and GGUF metadata read into ModelConfig; what
a family does not compute (RoPE scalings, partial rotary, activations) refused at load; the dtype a name resolves to."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve import kernels
from kvserve.errors import ModelLoadError
from kvserve.model import ModelConfig, load_hf_config, resolve_dtype
from kvserve.model.loader import cpu_has_fast_bf16
from model_utils import load_ours, save_tiny_model


def test_hf_config_fields(tmp_path):
    save_tiny_model("llama", tmp_path, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 32})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg = load_hf_config(str(tmp_path))
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["factor"] == 8.0 and "rope_theta" not in cfg.rope_scaling
    assert cfg.eos_token_ids == [2, 7] and cfg.torch_dtype == torch.float32


def test_hf_config_legacy_rope_fields():
    cfg = ModelConfig.from_hf_config({
        "architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1e6, "max_position_embeddings": 32768,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "sliding_window": 4096, "torch_dtype": "bfloat16"})
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (cfg.num_key_value_heads, cfg.head_dim) == (2, 4)
    assert cfg.max_position_embeddings == 32768  # not capped: every attention backend has the window
    assert cfg.sliding_window == 4096 and cfg.layer_types == ["sliding_attention"]   # Mistral: every layer
    assert cfg.torch_dtype == torch.bfloat16


def test_gguf_metadata_qwen2_and_qwen3_keys():
    base = {"block_count": 2, "context_length": 4096, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 1e6,
            "attention.layer_norm_rms_epsilon": 1e-6}
    for arch, head_dim in [("qwen2", 16), ("qwen3", 32)]:
        meta = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in base.items()},
                "tokenizer.ggml.eos_token_id": 5, "tokenizer.ggml.eot_token_id": 6}
        if arch == "qwen3":
            meta["qwen3.attention.key_length"] = 32
        cfg = ModelConfig.from_gguf_metadata(meta, vocab_rows=300, has_output=True)
        assert cfg.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
        assert (cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (head_dim, 300, False)
        assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
        assert cfg.eos_token_ids == [5, 6]


def test_unsupported_rope_scaling(tmp_path):
    save_tiny_model("llama", tmp_path, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        load_ours(str(tmp_path))


def test_the_loaded_model_says_why_auto_picked_its_dtype():
    """dtype="auto" leaves its reason on the model for the engine's log; an explicit dtype none."""
    from kvserve.config import EngineConfig
    from kvserve.model import load_model
    from kvserve.model.loader import auto_dtype
    auto, _ = load_model(EngineConfig(dtype="auto", device="cpu"))
    assert auto.dtype_reason == auto_dtype("cpu", None)[1] and auto.dtype_reason
    assert load_model(EngineConfig(dtype="float32", device="cpu"))[0].dtype_reason is None


def test_resolve_dtype():
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("half", "cpu") == torch.float16
    fast = kernels.status().fast_bf16 or cpu_has_fast_bf16()   # the packed bf16 kernels (AVX2 or AVX-512 BF16)
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if fast else torch.float32)
    with kernels.variant("portable"):   # no vectorized bf16 kernels: float32, unless torch has native bf16
        assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("int4", "cpu")


@pytest.mark.parametrize("extra,message", [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                       "original_max_position_embeddings": 16}}, "rope scaling type 'longrope' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_phi3_features_we_do_not_compute_are_refused_at_load(tmp_path, extra, message):
    from model_utils import tiny_hf_config
    from kvserve.model.registry import build_model
    cfg = tiny_hf_config("phi3").to_dict()
    cfg.pop("rope_parameters", None)
    cfg.update(architectures=["Phi3ForCausalLM"], **extra)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        build_model(load_hf_config(str(tmp_path)))


def test_a_bpe_tokenizer_drops_its_python_vocabulary_and_merges_and_tokenizes_the_same():
    """transformers' Gemma/Llama tokenizers keep the Python vocabulary and merges they built their Rust tokenizer
    from (hundreds of MB for Gemma's 262,144 tokens); release_build_state drops them, and the tokenizer encodes,
    decodes and saves as before."""
    import tempfile
    from transformers import AutoTokenizer, GemmaTokenizer
    from kvserve.model.tokenizer import release_build_state
    letters = "abcdehlorw▁"
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *letters, "he", "ll", "hell",
                                         "hello", "▁w", "▁wo", "or", "▁wor"])}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "w"), ("▁w", "o"), ("o", "r"), ("▁wo", "r")]
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    text = "hello world, hello"
    ids = tok.encode(text)
    assert release_build_state(tok) is tok and tok._vocab == {} and tok._merges == []
    assert tok.encode(text) == ids and tok.decode(ids) == tok.decode(ids, skip_special_tokens=False)
    assert {"hello", "▁wor"} <= set(tok.convert_ids_to_tokens(ids))   # the merges apply
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        assert AutoTokenizer.from_pretrained(d).encode(text) == ids
