"""Our forward pass (flattened tokens, paged attention) gives transformers' logits for every supported family."""
from __future__ import annotations

import pytest
import torch

from kvserve.attention import bind_kv_cache, build_attention_metadata
from model_utils import (LLAMA3_ROPE, bundled_ours, hf_logits, load_ours, run_single_sequence,
                         save_tiny_model, write_tiny_gguf)

PROMPT = list(range(3, 43))  # 40 tokens: past llama3's original 32-token context, over 2 KV blocks of 16


@pytest.mark.parametrize("family,overrides", [
    ("llama", {}),
    ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    ("mistral", {"num_key_value_heads": 1}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {"sliding_window": 8}),   # a window shorter than the prompt, on every layer
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),   # on the second only
    ("phi3", {}),   # q|k|v and gate|up fused in the checkpoint
    ("phi3", {"sliding_window": 8}),
    ("gemma2", {}),   # soft-capped attention and logits, every other layer local
])
def test_tiny_model_logits_match_transformers(tmp_path, family, overrides):
    hf = save_tiny_model(family, tmp_path, **overrides)
    ours, _ = load_ours(str(tmp_path))
    expected = hf_logits(hf, PROMPT)
    got = run_single_sequence(ours, PROMPT)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_tiny_gguf_logits_match_transformers(tmp_path):
    hf = save_tiny_model("llama", tmp_path / "hf")
    ours, _ = load_ours(str(write_tiny_gguf(tmp_path / "tiny.gguf", hf)))
    torch.testing.assert_close(run_single_sequence(ours, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_chunked_prefill_decode_and_batching_match_one_shot(tmp_path):
    """Prefill in two chunks, then decode, with a second sequence in the same steps: same logits as one shot."""
    hf = save_tiny_model("qwen3", tmp_path)
    ours, _ = load_ours(str(tmp_path))
    a, b = PROMPT[:24], [7, 9, 11, 13, 200, 3]
    full_a, full_b = hf_logits(hf, a), hf_logits(hf, b)
    bind_kv_cache(ours, num_blocks=8, block_size=4, dtype=torch.float32)
    tables = [[5, 0, 7, 2, 1, 6], [3, 4]]  # deliberately scattered blocks
    steps = [((0, 10), (0, 5)), ((10, 23), (5, 6)), ((23, 24), None)]  # token ranges of a and b per step
    for step_a, step_b in steps:
        ids, pos, qlens, slens, used = [], [], [], [], []
        for seq, rng, table in ((a, step_a, tables[0]), (b, step_b, tables[1])):
            if rng is None:
                continue
            ids += seq[rng[0]:rng[1]]
            pos += list(range(*rng))
            qlens.append(rng[1] - rng[0])
            slens.append(rng[1])
            used.append(table)
        meta = build_attention_metadata(qlens, slens, used, block_size=4)
        with torch.inference_mode():
            logits = ours.compute_logits(ours(torch.tensor(ids), torch.tensor(pos), meta))
        torch.testing.assert_close(logits[:qlens[0]], full_a[step_a[0]:step_a[1]], atol=1e-4, rtol=0)
        if step_b is not None:
            torch.testing.assert_close(logits[qlens[0]:], full_b[step_b[0]:step_b[1]], atol=1e-4, rtol=0)


def test_bundled_smollm2_logits_match_transformers_gguf(hf_reference):
    from kvserve.model import load_tokenizer
    tok = load_tokenizer(None)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of")
    assert 15 <= len(ids) <= 25
    ours, _ = bundled_ours()
    expected = hf_logits(hf_reference, ids)
    got = run_single_sequence(ours, ids)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert tok.decode(int(got[-1].argmax())).strip() == "France"
