"""Greedy output of the engine is token-identical to transformers in float32, logprobs within 1e-3,
requests one at a time, all in one batch, with chunked prefill and under preemption, on every kernel path."""
import pytest
import torch

from kvserve import LLM, SamplingParams, kernels

MAX_TOKENS = 12
TOP = 3
CHATS = [
    [{"role": "user", "content": "Name three planets."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 12 times 12?"}],
]
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4, 5,",
    "Hi",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
    "foods from carbon dioxide and water. Photosynthesis in plants generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct. Explain in simple words why plants need light:",
]


@pytest.fixture(scope="module")
def prompts(gguf_path):
    from kvserve.model import load_tokenizer
    tok = load_tokenizer(gguf_path)
    ids = [tok.encode(t) for t in TEXTS]
    ids += [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) for c in CHATS]
    assert len(ids) == 8 and max(map(len, ids)) > 40 and 2 in ids[-1]   # chat prompts contain <|im_end|> (id 2)
    return ids


@pytest.fixture(scope="module")
def reference(hf_reference, prompts):
    """Greedy tokens and raw logprobs from transformers' forward passes, all prompts in one batch: left-padded,
    with the attention mask and each token's position given explicitly, and a KV cache across the steps.

    A plain loop, not generate(): no logits processors, and eos is just another token (ignore_eos)."""
    b, longest = len(prompts), max(map(len, prompts))
    x = torch.zeros(b, longest, dtype=torch.long)
    mask = torch.zeros(b, longest, dtype=torch.long)
    for i, ids in enumerate(prompts):
        x[i, longest - len(ids):], mask[i, longest - len(ids):] = torch.tensor(ids), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    refs, past = [([], []) for _ in prompts], None
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            out = hf_reference(input_ids=x, attention_mask=mask, position_ids=positions, past_key_values=past,
                               use_cache=True)
            lp = torch.log_softmax(out.logits[:, -1].float(), -1)
            past, x = out.past_key_values, lp.argmax(-1, keepdim=True)
            for (tokens, lps), row, token in zip(refs, lp, x[:, 0].tolist()):
                tokens.append(token)
                lps.append(row)
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
            positions = positions[:, -1:] + 1
    return refs


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)


def check_against_reference(outputs, reference):
    for out, (ref_tokens, ref_lps) in zip(outputs, reference):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens
        for pos, lp in enumerate(comp.logprobs):
            ref_top = torch.topk(ref_lps[pos], TOP)
            for tid, value in zip(ref_top.indices.tolist(), ref_top.values.tolist()):
                assert lp[tid].logprob == pytest.approx(value, abs=1e-3)
            assert lp[ref_tokens[pos]].rank == 1


def make_llm(**kw):
    # the transformers reference loads the GGUF dequantized: so does the engine under test
    return LLM(dtype="float32", enable_prefix_caching=False, quantization="none", **kw)


@pytest.fixture(scope="module")
def llm():
    return make_llm(max_num_seqs=16)


ALONE = [4, 5, 7]   # the shortest prompt, the longest, a chat: each alone takes the single-sequence kernels


def test_one_at_a_time(llm, prompts, reference):
    outs = [llm.generate({"prompt_token_ids": prompts[i]}, PARAMS, use_tqdm=False)[0] for i in ALONE]
    check_against_reference(outs, [reference[i] for i in ALONE])


def test_all_in_one_batch(llm, prompts, reference):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    check_against_reference(outs, reference)


def test_chunked_prefill_and_preemption_with_a_tiny_budget_and_pool(prompts, reference):
    """Steps of 13 tokens chunk the longer prompts (the longest has 50 tokens); a pool of 12 blocks of 8 preempts
    requests."""
    llm = make_llm(num_kv_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=13)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check_against_reference(outs, reference)
    assert llm.llm_engine.kv.num_free_blocks == 12


def test_async_scheduling_with_chunked_prefill_and_preemption(prompts, reference):
    """Each step launched before the last one's tokens are back (placeholders read on the device), through chunked
    prefill and preemption: the same tokens and logprobs as transformers."""
    llm = make_llm(async_scheduling=True, num_kv_blocks=12, block_size=8, max_model_len=96,
                   max_num_batched_tokens=13)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check_against_reference(outs, reference)
    assert llm.llm_engine.kv.num_free_blocks == 12 and llm.llm_engine._pending is None


@pytest.mark.parametrize("variant, words", [("portable", "portable: no AVX2"), ("none", "no C++ kernels")])
def test_fallback_kernel_paths_equal_transformers(variant, words, prompts, reference, caplog):
    """The portable C++ build (what a CPU without AVX-512 runs) and plain torch (no compiler, or a failed build)
    compute the same model: a batch with chunked prefill and preemption, on whatever CPU runs the tests. The
    engine warns which path it runs."""
    with kernels.variant(variant), caplog.at_level("WARNING", logger="kvserve"):
        llm = make_llm(num_kv_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=13)
        assert words in llm.llm_engine.kernel_summary
        assert any(r.levelname == "WARNING" and words in r.getMessage() for r in caplog.records)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check_against_reference(outs, reference)
