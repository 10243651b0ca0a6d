"""transformers as the test reference: its model on a GGUF file's weights in float32 (conftest.py's hf_reference
fixture, benchmarks/gpu_model_check.py) and its greedy output with each token's logprob."""
from __future__ import annotations

import functools
import os
from unittest import mock


def load_gguf_reference(gguf_path: str, device: str = "cpu"):
    """transformers' model on the GGUF's weights dequantized to float32, in eval mode on `device`.

    Loading it, transformers parses the file twice and rebuilds gguf's tensor name map for every tensor (most of
    its load time): both are memoized while it loads, and the parse runs as kvserve's does (open_gguf), which
    changes nothing it computes."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from kvserve.model.gguf_loader import _plain_view_reader
    readers = {}
    real_reader = _plain_view_reader()   # gguf's reader, parsing through a plain view of the file: the same fields

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(None)(gguf.get_tensor_name_map)):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path),
                                                     gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    return model.to(device).eval()


def greedy_with_logprobs(model, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy output for each prompt (token ids) and each token's logprob: max_tokens each, with EOS
    an ordinary token (as ignore_eos; generate's min_new_tokens would mask it instead), the argmax of a forward
    over the whole sequence at each step (attention mask explicit)."""
    import torch
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            logprobs = []
            for _ in range(max_tokens):
                logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
                token = logits.argmax()
                logprobs.append(torch.log_softmax(logits, -1)[token].item())
                ids = torch.cat([ids, token.view(1, 1)], dim=1)
            out.append((ids[0, len(prompt):].tolist(), logprobs))
    return out
