"""Gemma 2 and 3: a tiny random checkpoint gives transformers' logits (windows shorter than the prompt; Gemma 3's
local and global layers on their own RoPE bases and q/k norm; Gemma 2's soft-capped attention and logits; GeGLU,
sandwich norms, scaled embeddings), and the engine's greedy output equals transformers' through batching, chunked
prefill, preemption and the prefix cache; a Gemma 2 GGUF written as llama.cpp's converter writes one loads to the
same logits; the real Gemma-3-270M GGUF (make models) gives the logits transformers gives for the same file, on a
prompt past its 512-token window."""
from __future__ import annotations

import pytest
import torch

from kvserve.attention import bind_kv_cache, build_attention_metadata
from model_utils import (check_engine_greedy, gguf_without_vocabulary, hf_logits, load_ours, run_single_sequence,
                         save_tiny_model, write_tiny_gguf)

PROMPT = list(range(3, 43))   # 40 tokens: five windows of 8
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(tmp_path_factory, request):
    """(path, transformers model) of a tiny random Gemma 2 or 3."""
    path = tmp_path_factory.mktemp(request.param)
    return str(path), save_tiny_model(request.param, path)


def test_tiny_gemma_logits_match_transformers(tiny):
    path, hf = tiny
    ours, cfg = load_ours(path)
    assert [layer.self_attn.attn.sliding_window for layer in ours.model.layers] == [8, None, 8]
    expected = hf_logits(hf, PROMPT)
    torch.testing.assert_close(run_single_sequence(ours, PROMPT), expected, atol=1e-4, rtol=0)
    for layer in ours.model.layers:   # the windows matter: without them the logits are another model's
        layer.self_attn.attn.sliding_window = None
    assert (run_single_sequence(ours, PROMPT) - expected).abs().max() > 1e-2
    if cfg.architecture == "Gemma2ForCausalLM":   # and so do the caps
        ours, _ = load_ours(path)
        for layer in ours.model.layers:
            layer.self_attn.attn.softcap = None
        assert (run_single_sequence(ours, PROMPT) - expected).abs().max() > 1e-2
        assert run_single_sequence(ours, PROMPT).abs().max() <= cfg.final_logit_softcapping


def test_a_gemma2_gguf_loads_to_the_same_logits(tmp_path):
    """llama.cpp's names (ffn_norm before the MLP, post_attention_norm, post_ffw_norm), its norms stored as 1 + w,
    its soft-cap and window keys (a GGUF has no query scale: llama.cpp takes head_dim's, so the model does too)."""
    hf = save_tiny_model("gemma2", tmp_path / "hf", query_pre_attn_scalar=32)
    ours, cfg = load_ours(str(write_tiny_gguf(tmp_path / "tiny.gguf", hf, arch="gemma2")))
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.5, 2.0)
    torch.testing.assert_close(run_single_sequence(ours, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_tiny_gemma_chunks_and_batches_match_one_shot(tiny):
    """Prefill in chunks that start inside and past the window, then decode, beside a second sequence."""
    path, hf = tiny
    ours, _ = load_ours(path)
    a, b = PROMPT[:30], [7, 9, 11, 13, 200, 3, 5, 90, 91, 92, 17]
    full_a, full_b = hf_logits(hf, a), hf_logits(hf, b)
    bind_kv_cache(ours, num_blocks=14, block_size=4, dtype=torch.float32)
    tables = [[5, 0, 7, 2, 1, 6, 8, 13, 9], [3, 4, 10, 11]]
    for step_a, step_b in [((0, 6), (0, 5)), ((6, 19), (5, 10)), ((19, 29), (10, 11)), ((29, 30), None)]:
        ids, pos, qlens, slens, used = [], [], [], [], []
        for seq, rng, table in ((a, step_a, tables[0]), (b, step_b, tables[1])):
            if rng is not None:
                ids, pos = ids + seq[rng[0]:rng[1]], pos + list(range(*rng))
                qlens.append(rng[1] - rng[0])
                slens.append(rng[1])
                used.append(table)
        with torch.inference_mode():
            logits = ours.compute_logits(ours(torch.tensor(ids), torch.tensor(pos),
                                              build_attention_metadata(qlens, slens, used, block_size=4)))
        torch.testing.assert_close(logits[:qlens[0]], full_a[step_a[0]:step_a[1]], atol=1e-4, rtol=0)
        if step_b is not None:
            torch.testing.assert_close(logits[qlens[0]:], full_b[step_b[0]:step_b[1]], atol=1e-4, rtol=0)


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(MAX_TOKENS):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_engine_greedy_equals_transformers(tiny, gguf_path):
    """Prompts past the window, in one batch, in chunks of 7 tokens, with a pool so small that requests are
    preempted, and twice over with the prefix cache on (the second time from cached blocks)."""
    path, hf = tiny

    def windows(engine):   # the local layers' blocks leave the pool
        assert engine.kv.groups.windows == (None, 8, 8)
    check_engine_greedy(path, gguf_path, lambda p: _hf_greedy(hf, p), 40, windows)


def test_gemma3_270m_gguf_logits_match_transformers(tmp_path):
    """The real file, dequantized (as transformers reads it; its vocabulary left out of transformers' copy), on a
    prompt past the 512-token window."""
    from kvserve.model.fetch import model_path
    from kvserve.model.tokenizer import load_gguf_tokenizer
    path = model_path("gemma-3-270m")
    if path is None:
        pytest.skip("Gemma-3-270M is not fetched: make models")
    from transformers_reference import load_gguf_reference
    ids = load_gguf_tokenizer(path)("The history of the Roman Empire is long. " * 80).input_ids[:540]
    assert len(ids) == 540   # past the 512-token window
    ours, cfg = load_ours(path)
    assert cfg.sliding_window == 512 and cfg.layer_types.count("full_attention") == 3
    got = run_single_sequence(ours, ids)
    del ours
    copy = gguf_without_vocabulary(path, tmp_path / path.name)
    expected = hf_logits(load_gguf_reference(str(copy)), ids)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
