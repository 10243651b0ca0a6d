"""Model registry: HF architecture name -> model class; a new family is a new file plus one entry here."""
from __future__ import annotations

from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.model.bert import BertModel
from kvserve.model.gemma2 import Gemma2ForCausalLM
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.mixtral import MixtralForCausalLM
from kvserve.model.olmoe import OlmoeForCausalLM
from kvserve.model.phi3 import Phi3ForCausalLM
from kvserve.model.model_config import ModelConfig

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,   # ModelConfig.attention_bias turns on the qkv bias
    "Qwen3ForCausalLM": LlamaForCausalLM,   # ModelConfig.qk_norm turns on q_norm/k_norm
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # mixtures of experts (moe.py)
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,   # with a shared expert
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    # encoders, for pooling (embeddings)
    "BertModel": BertModel,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for an HF architecture name, or ModelLoadError if unsupported."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(f"architecture {architecture!r} is not supported; "
                             f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None


def build_model(cfg: ModelConfig) -> nn.Module:
    """Instantiate the model for `cfg` (parameters uninitialized until load_weights)."""
    return get_model_class(cfg.architecture)(cfg)
