"""Shared fixtures: the bundled model's path and a transformers reference on the same weights."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def gguf_path():
    from kvserve.model import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_reference(gguf_path):
    """transformers' own model on the bundled GGUF weights in float32 (test-only reference)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                 dtype=torch.float32)
    return model.eval()
