"""Engine features on the bundled model: seeds, n > 1, stops, logprobs, prompt logprobs, output kinds, abort."""
import pytest
import torch

from kvserve import LLM, RequestOutputKind, SamplingParams

PROMPT = "Write a short poem about the sea:"


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=16, quantization="none")   # as transformers


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_same_seed_same_tokens_whatever_else_is_in_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = gen(llm, PROMPT, seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=12), SamplingParams(temperature=0, max_tokens=5),
              seeded, SamplingParams(temperature=1.0, seed=99, max_tokens=12)]
    batch = gen(llm, ["Hello there", "Tell me a joke", PROMPT, PROMPT], others)
    assert batch[2].outputs[0].token_ids == alone
    assert batch[3].outputs[0].token_ids != alone


def test_engine_seed_makes_unseeded_sampling_reproducible():
    """EngineConfig.seed (serve --seed) seeds the requests that have no seed of their own, as in vLLM."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for seed in (3, 3, 4):
        engine = LLM(dtype="float32", max_model_len=128, num_kv_blocks=32, seed=seed)
        runs.append([o.outputs[0].token_ids for o in gen(engine, [PROMPT, "Hello", "Once upon a time"], params)])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_n_samples_are_indexed_and_differ_under_sampling(llm):
    out = gen(llm, PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    greedy = gen(llm, PROMPT, SamplingParams(n=2, temperature=0, max_tokens=10))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_max_tokens_gives_length_finish(llm):
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length" and out.stop_reason is None


def test_stop_string_truncates_and_is_reported(llm):
    free = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].text
    stop = free[10:14]
    assert stop.strip()
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert out.text == free[:free.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=stop,
                                           include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free[:free.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    free = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[2]
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:3] and out.finish_reason == "stop" and out.stop_reason == stop_id
    first = free.token_ids[0]
    held = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=6, min_tokens=4,
                                           stop_token_ids=[first]))[0].outputs[0]
    assert held.token_ids[0] != first and len(held.token_ids) >= 4


def test_logprobs_include_the_sampled_token_and_top_k(llm):
    out = gen(llm, PROMPT, SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=4))[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for tid, pos in zip(out.token_ids, out.logprobs):
        assert tid in pos and len(pos) >= 4
        ranks = sorted(lp.rank for t, lp in pos.items() if t != tid or lp.rank <= 4)
        assert ranks[:4] == [1, 2, 3, 4]
        total += pos[tid].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert all(isinstance(lp.decoded_token, str) for pos in out.logprobs for lp in pos.values())


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_transformers(llm, hf_reference, chunked):
    # chunked: the prompt prefilled 4 tokens a step, each step's logprobs put in place
    engine = LLM(dtype="float32", max_model_len=256, quantization="none", max_num_batched_tokens=4) if chunked else llm
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog")
    assert len(ids) > 8 and (not chunked or engine.llm_engine.scheduler.max_num_batched_tokens < len(ids))
    out = gen(engine, {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.no_grad():
        x = torch.tensor([ids])
        ref = torch.log_softmax(hf_reference(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float(), -1)
    for i in range(1, len(ids)):
        assert out.prompt_logprobs[i][ids[i]].logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-3)


def test_token_id_prompts_equal_text_prompts(llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    ids = llm.get_tokenizer().encode(PROMPT)
    a, b = gen(llm, [PROMPT, {"prompt_token_ids": ids}], params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.prompt_token_ids == ids


def test_delta_outputs_concatenate_to_the_final_text(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", "Count from one to ten:", params)
    text, tokens, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
            final = out
    assert final.finished
    full = gen(llm, "Count from one to ten:", SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert text == full.text and tokens == full.token_ids


def test_final_outputs_of_n_samples_are_their_tokens_text(llm):
    """LLM.generate's outputs (FINAL_ONLY, no stop strings: each sample's tokens decoded once, when it ends): every
    sample of every request is there once, with the text of its tokens, samples ending at different steps."""
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=24)
    outs = gen(llm, ["Tell me a story about a dragon.", "Write a haiku about 🍣 and ☕."], params)
    assert len(outs) == 2 and all(o.finished and len(o.outputs) == 3 for o in outs)
    for out in outs:
        for c in out.outputs:
            ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids   # the stop token's text is left out
            assert c.text == tok.decode(ids, skip_special_tokens=True)
    assert len({len(c.token_ids) for o in outs for c in o.outputs}) > 1, "some samples should end before others"


def test_abort_frees_the_blocks(llm):
    engine = llm.llm_engine
    free = engine.kv.num_free_blocks
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv.num_free_blocks < free
    [out] = engine.abort_request("x")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv.num_free_blocks == free and not engine.has_unfinished_requests()


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=8),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert out.outputs[0].text


def test_delta_outputs_with_n_carry_only_the_samples_that_changed(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=0, max_tokens=3, output_kind=RequestOutputKind.DELTA,
                            ignore_eos=True)
    engine.add_request("nd", PROMPT, params)
    finishes, seen = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen += [o.index for o in out.outputs]
            finishes += [o.index for o in out.outputs if o.finish_reason]
    assert sorted(finishes) == [0, 1]                 # each finish reported exactly once
    assert seen.count(0) == 3 and seen.count(1) == 3  # one delta per generated token per sample


def test_max_tokens_none_runs_to_what_the_kv_pool_holds():
    small = LLM(dtype="float32", max_model_len=2048, num_kv_blocks=4, block_size=16)
    out = small.generate({"prompt_token_ids": [1] * 20}, SamplingParams(max_tokens=None, ignore_eos=True,
                                                                         temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 * 16 - 20 and out.outputs[0].finish_reason == "length"
