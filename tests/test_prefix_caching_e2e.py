"""Prefix caching and forked samples on the bundled model: outputs equal caching off, hits are real."""
import pytest

from kvserve import LLM, SamplingParams

SYSTEM = ("You are a meticulous assistant for a shipping company. Answer in one sentence, cite the relevant "
          "policy number, never invent tracking numbers, and keep a friendly but professional tone. ") * 3
QUESTIONS = ["Where is my parcel?", "Can I change the delivery address?", "How do refunds work?",
             "Do you ship to Iceland?"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def chat_prompt(tok, messages):
    return {"prompt_token_ids": tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                                                   add_generation_prompt=True),
                                           add_special_tokens=False)}


@pytest.fixture(scope="module")
def cached():
    return LLM(dtype="float32", max_model_len=512, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def uncached():
    return LLM(dtype="float32", max_model_len=512, enable_prefix_caching=False)


def assert_same(a, b):
    for x, y in zip(a, b):
        for ox, oy in zip(x.outputs, y.outputs):
            assert ox.token_ids == oy.token_ids
            for px, py in zip(ox.logprobs, oy.logprobs):
                for tid, lp in py.items():
                    assert px[tid].logprob == pytest.approx(lp.logprob, abs=1e-3)


def test_shared_system_prompt_hits_and_matches(cached, uncached):
    tok = cached.get_tokenizer()
    prompts = [chat_prompt(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    first = cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    ref = uncached.generate(prompts, GREEDY, use_tqdm=False)
    assert_same(first + rest, ref)
    assert first[0].num_cached_tokens == 0
    shared = len(tok.encode(SYSTEM))
    assert all(r.num_cached_tokens >= shared - 16 for r in rest)
    assert all(r.num_cached_tokens == 0 for r in ref)


def test_multi_turn_chat_hits_the_previous_answer(cached, uncached):
    tok = cached.get_tokenizer()
    turn1 = [{"role": "user", "content": "Give me a fun fact about octopuses."}]
    a1 = cached.generate(chat_prompt(tok, turn1), GREEDY, use_tqdm=False)[0]
    turn2 = turn1 + [{"role": "assistant", "content": a1.outputs[0].text},
                     {"role": "user", "content": "And one about squids?"}]
    p2 = chat_prompt(tok, turn2)
    a2 = cached.generate(p2, GREEDY, use_tqdm=False)[0]
    ref = uncached.generate(p2, GREEDY, use_tqdm=False)[0]
    assert_same([a2], [ref])
    assert a2.num_cached_tokens >= (len(a1.prompt_token_ids) // 16) * 16


def test_preempted_requests_with_caching_match_caching_off():
    tok_prompts = [{"prompt_token_ids": list(range(1000, 1000 + 40)) + [i] * (5 + i)} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    on = LLM(dtype="float32", max_model_len=128, num_kv_blocks=10, block_size=8, enable_prefix_caching=True)
    off = LLM(dtype="float32", max_model_len=128, num_kv_blocks=10, block_size=8, enable_prefix_caching=False)
    a = on.generate(tok_prompts, params, use_tqdm=False)
    b = off.generate(tok_prompts, params, use_tqdm=False)
    assert on.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert on.llm_engine.kv.num_free_blocks == 10


def test_forked_samples_equal_independent_seeded_requests(cached):
    prompt = "List some colors of the rainbow:"
    many = cached.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10), use_tqdm=False)[0]
    for i, out in enumerate(many.outputs):
        single = cached.generate(prompt, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10),
                                 use_tqdm=False)[0]
        assert out.token_ids == single.outputs[0].token_ids


def test_n_samples_of_a_long_prompt_share_blocks(cached):
    engine = cached.llm_engine
    ids = list(range(2000, 2000 + 300))
    free = engine.kv.num_free_blocks
    engine.add_request("share", {"prompt_token_ids": ids}, SamplingParams(n=8, max_tokens=20, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, free - engine.kv.num_free_blocks)
    one_prompt = -(-300 // 16)
    assert peak <= one_prompt + 8 * 3      # one prompt + per sample a copied tail block and its output blocks
    assert peak < 8 * one_prompt // 2


def test_cache_salt_separates_and_reset_clears(cached):
    ids = list(range(3000, 3000 + 64))
    p = SamplingParams(temperature=0, max_tokens=2)
    cached.generate({"prompt_token_ids": ids}, p, use_tqdm=False)
    assert cached.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0].num_cached_tokens == 48
    salted = cached.generate({"prompt_token_ids": ids, "cache_salt": "tenant-7"}, p, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0
    assert cached.reset_prefix_cache()
    assert cached.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0].num_cached_tokens == 0
