"""Model code (every family on one declared decoder) and loaders for HF safetensors directories and GGUF files."""
from kvserve.model.loader import (default_model_path, load_hf_config, load_model, load_model_config, resolve_device,
                                  resolve_dtype)
from kvserve.model.model_config import ModelConfig
from kvserve.model.registry import MODEL_REGISTRY, build_model, get_model_class
from kvserve.model.tokenizer import load_tokenizer

__all__ = ["MODEL_REGISTRY", "ModelConfig", "build_model", "default_model_path", "get_model_class",
           "load_hf_config", "load_model", "load_model_config", "load_tokenizer", "resolve_device", "resolve_dtype"]
