"""Every bad input gets a typed error that says what is wrong, and nothing else is disturbed."""
import logging

import pytest

from kvserve import (LLM, ContextLengthExceededError, EngineConfig, InvalidRequestError, ModelLoadError,
                     SamplingParams)
from kvserve.errors import RequestFailedError
from kvserve.sampling_params import RequestOutputKind
from model_utils import FailingForward


@pytest.mark.parametrize("kwargs, param, words", [
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"temperature": -0.5}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -3}, "top_k", "top_k"),
    ({"n": 0}, "n", ">= 1"),
    ({"min_p": 2}, "min_p", "[0, 1]"),
    ({"logprobs": 50}, "logprobs", "[0, 20]"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "<= max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty", "finite"),
    ({"top_p": "0.5"}, "top_p", "finite number"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias", "finite"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias", "token ids"),
    ({"logit_bias": [1]}, "logit_bias", "token ids"),
    ({"stop": 5}, "stop", "must be a list"),
    ({"stop_token_ids": 3}, "stop_token_ids", "must be a list"),
    ({"seed": 2**64}, "seed", "64 bits"),
    ({"seed": -2**63 - 1}, "seed", "64 bits"),
])
def test_bad_sampling_params(kwargs, param, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and words in str(e.value)


def test_bad_engine_config():
    with pytest.raises(InvalidRequestError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(InvalidRequestError, match="cannot parse the size .lots. .kv_cache_memory."):
        EngineConfig(kv_cache_memory="lots")


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("/no/such/model")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        LLM(str(bad))


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=64, num_kv_blocks=16, block_size=16)


@pytest.mark.parametrize("prompt, error, words", [
    ("", InvalidRequestError, "empty"),
    ({"prompt_token_ids": []}, InvalidRequestError, "no tokens"),
    ({"prompt_token_ids": [1, 10**9]}, InvalidRequestError, "vocabulary"),
    ({"prompt_token_ids": list(range(1, 70))}, ContextLengthExceededError, "maximum context length"),
    (12.5, InvalidRequestError, "must be a string"),
    ({"text": "hi"}, InvalidRequestError, "prompt_token_ids"),
])
def test_bad_prompts(llm, prompt, error, words):
    with pytest.raises(error) as e:
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
    assert words in str(e.value) or words.replace("vocabulary", "[0,") in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_plus_max_tokens_over_the_context(llm):
    with pytest.raises(ContextLengthExceededError, match="max_tokens=60"):
        llm.generate({"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=60), use_tqdm=False)


@pytest.fixture(scope="module")
def small_pool():
    """A KV pool of 64 tokens under a context of 512: requests are bounded by the pool, not the context."""
    return LLM(dtype="float32", max_model_len=512, num_kv_blocks=4, block_size=16)


def test_request_larger_than_the_whole_kv_pool(small_pool):
    with pytest.raises(ContextLengthExceededError, match="whole KV cache"):
        small_pool.generate({"prompt_token_ids": [1] * 40}, SamplingParams(max_tokens=40), use_tqdm=False)


def test_a_prompt_the_pool_cannot_hold_is_refused_whatever_max_tokens(small_pool):
    """Without max_tokens it used to be queued with a negative budget, and blocked every later request."""
    for max_tokens in (None, 1):
        with pytest.raises(ContextLengthExceededError) as e:
            small_pool.generate({"prompt_token_ids": [1] * 100}, SamplingParams(max_tokens=max_tokens),
                                use_tqdm=False)
        assert e.value.param == "prompt"
        assert all(w in str(e.value) for w in ("100 prompt", "7 KV blocks", "has 4 blocks", "kv_cache_memory"))
    assert not small_pool.llm_engine.has_unfinished_requests()
    out = small_pool.generate({"prompt_token_ids": [1] * 63}, SamplingParams(max_tokens=None, temperature=0,
                                                                              ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1   # the default max_tokens is what the pool leaves, never below 1


def test_start_up_says_when_the_pool_is_smaller_than_the_context(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        LLM(dtype="float32", max_model_len=512, num_kv_blocks=4, block_size=16)
    [line] = [r.getMessage() for r in caplog.records if "fewer than max_model_len" in r.getMessage()]
    assert "holds 64 tokens" in line and "largest request that fits has 64 tokens" in line


def test_n_beyond_max_num_seqs_is_refused():
    llm = LLM(dtype="float32", max_model_len=64, num_kv_blocks=16, max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match="max_num_seqs=4") as e:
        llm.generate("hi", SamplingParams(n=5, max_tokens=2), use_tqdm=False)
    assert e.value.param == "n" and len(llm.generate("hi", SamplingParams(n=4, max_tokens=2),
                                                     use_tqdm=False)[0].outputs) == 4


# four prompts on an engine that runs two at a time: a fault in the first step hits r0 and r1, r2 and r3 wait
STEP_PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11], [12, 13]]


def two_at_a_time(max_tokens: int):
    """The engine, the greedy params, and the tokens STEP_PROMPTS get without a fault."""
    llm = LLM(dtype="float32", max_model_len=128, num_kv_blocks=32, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(step_prompts(), params, use_tqdm=False)]
    return llm, params, expected


def step_prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in STEP_PROMPTS]


def add_step_prompts(engine, params) -> None:
    for i, prompt in enumerate(step_prompts()):
        engine.add_request(f"r{i}", prompt, params)


def run_to_the_end(engine) -> dict[str, list[int]]:
    """Step until nothing is left; the tokens of every request that finished."""
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return done


def test_a_failing_step_fails_only_its_requests():
    """The running requests of the failing step end with RequestFailedError; waiting ones stay queued and finish
    with the tokens they get without the fault; every block comes back."""
    llm, params, expected = two_at_a_time(max_tokens=5)
    engine = llm.llm_engine
    engine.runner = FailingForward(engine.runner, STEP_PROMPTS[0])
    add_step_prompts(engine, params)
    assert engine.step() == []                 # r0 and r1 ran in it (max_num_seqs=2); r2 and r3 were waiting
    failed = engine.take_failed_requests()
    assert sorted(failed) == ["r0", "r1"] and all(isinstance(e, RequestFailedError) for e in failed.values())
    assert "injected" in str(failed["r0"])
    assert [r.request_id for r in engine.scheduler.waiting] == ["r2", "r3"]
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    assert run_to_the_end(engine) == {"r2": expected[2], "r3": expected[3]} and engine.take_failed_requests() == {}
    engine.runner.failed = False               # offline: the call raises a typed error naming the prompt
    with pytest.raises(RequestFailedError, match="prompt 0: .*injected"):
        llm.generate(step_prompts(), params, use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.num_kv_blocks
    again = llm.generate(step_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected


def test_logit_bias_token_outside_vocab(llm):
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)


def test_one_bad_prompt_rejects_the_call_and_loses_nothing(llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = llm.generate(["Hello", "Good morning"], params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.generate(["Hello", "", "Good morning"], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    again = llm.generate(["Hello", "Good morning"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_a_bad_request_does_not_disturb_a_running_one(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("good", "Hello", params)
    engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", "Hello", SamplingParams(max_tokens=1000))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", "Hello", params)
    final = None
    while engine.has_unfinished_requests():
        final = engine.step() or final
    assert final[0].request_id == "good" and final[0].outputs[0].token_ids == expected


def test_a_step_whose_output_processing_fails_leaks_nothing_and_spares_the_queue():
    """The hardest case: the step's requests finished (their parents already dropped by the output processor) before
    it raised. They still end with RequestFailedError, their blocks come back, and waiting requests run."""
    llm, params, expected = two_at_a_time(max_tokens=1)
    engine = llm.llm_engine
    real_process = engine.processor.process

    def process(updates):
        result = real_process(updates)
        if any(r.prompt_token_ids == STEP_PROMPTS[0] for r, _ in updates):
            raise RuntimeError("injected: the detokenizer failed")
        return result
    engine.processor.process = process
    add_step_prompts(engine, params)
    assert engine.step() == []
    failed = engine.take_failed_requests()
    assert sorted(failed) == ["r0", "r1"] and "injected" in str(failed["r1"])
    assert engine.kv.num_free_blocks == engine.num_kv_blocks and not engine.scheduler.running
    assert run_to_the_end(engine) == {"r2": expected[2], "r3": expected[3]}
    assert engine.kv.num_free_blocks == engine.num_kv_blocks and not engine.scheduler.requests


def test_priority_must_be_a_64_bit_integer_and_a_bad_one_leaves_nothing_behind():
    llm = LLM(dtype="float32", max_model_len=64, num_kv_blocks=16, scheduling_policy="priority")
    for bad in (10**400, 2**63, 1.5, True):
        with pytest.raises(InvalidRequestError, match="priority") as e:
            llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, priority=[bad])
        assert e.value.param == "priority"
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, priority=[-2**63])) == 1


class DecodeFails:
    """The engine's tokenizer, whose decode raises on one token id (a slow-tokenizer wrapper: no fast backend)."""

    is_fast = False

    def __init__(self, tokenizer, bad_id: int):
        self.tokenizer, self.bad_id = tokenizer, bad_id

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def decode(self, ids, **kwargs):
        if self.bad_id in ids:
            raise RuntimeError("injected: the tokenizer cannot decode this token")
        kwargs.pop("spaces_between_special_tokens", None)
        return self.tokenizer.decode(ids, **kwargs)


def test_a_token_the_detokenizer_cannot_decode_fails_its_request_only():
    """The failure must not strike again while the request is aborted (that would leave it half-removed and every
    later call spinning): the request fails, the one beside it finishes, and the engine stays usable."""
    llm = LLM(dtype="float32", max_model_len=128, num_kv_blocks=32)
    engine = llm.llm_engine
    engine.processor.tokenizer = DecodeFails(engine.tokenizer, 1000)
    forced = SamplingParams(temperature=0, max_tokens=4, logit_bias={1000: 100.0})
    fine = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("bad", "Hello", forced)
    engine.add_request("good", "Hello", fine)
    assert list(run_to_the_end(engine)) == ["good"] and "injected" in str(engine.take_failed_requests()["bad"])
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    with pytest.raises(RequestFailedError, match="prompt 1: .*injected"):
        llm.generate(["Hi", "Hello"], [fine, forced], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert len(llm.generate("Hi", fine, use_tqdm=False)[0].outputs[0].token_ids) == 4


class ByteLevelDecodeFails:
    """A bare tokenizers.Tokenizer with a byte-level decoder (as the detokenizer takes it), whose decode raises on one
    token id: a FINAL_ONLY request defers its decode to the end with it."""

    def __init__(self, backend, bad_id: int):
        self.backend, self.bad_id, self.decoder = backend, bad_id, backend.decoder

    def decode_batch(self, *args, **kwargs):
        return self.backend.decode_batch(*args, **kwargs)

    def decode(self, ids, skip_special_tokens=False):
        if self.bad_id in ids:
            raise RuntimeError("injected: the tokenizer cannot decode this token")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_an_aborted_final_only_request_whose_text_cannot_be_decoded_is_dropped():
    """A FINAL_ONLY request without stop strings decodes its text only when it ends: aborted before that, with a
    token its tokenizer cannot decode, it is dropped (logged; the caller gave it up) rather than raising out of the
    abort and staying behind; in generate, another request's failure still raises its own typed error."""
    llm = LLM(dtype="float32", max_model_len=128, num_kv_blocks=32)
    engine = llm.llm_engine
    engine.processor.tokenizer = ByteLevelDecodeFails(engine.tokenizer.backend_tokenizer, 1000)
    deferred = SamplingParams(temperature=0, max_tokens=8, logit_bias={1000: 100.0},
                              output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("bad", "Hello", deferred)
    for _ in range(3):
        assert engine.step() == []
    assert engine.has_unfinished_requests() and engine.take_failed_requests() == {}   # its decode is deferred
    assert engine.abort_request("bad") == []
    assert engine.take_failed_requests() == {}
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.num_kv_blocks
    at_once = SamplingParams(temperature=0, max_tokens=8, logit_bias={1000: 100.0}, stop=["never"])
    with pytest.raises(RequestFailedError, match="prompt 1: .*injected"):
        llm.generate(["Hi", "Hello"], [deferred, at_once], use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.num_kv_blocks
    assert len(llm.generate("Hi", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_a_call_interrupted_by_an_error_leaves_no_request_behind():
    llm = LLM(dtype="float32", max_model_len=128, num_kv_blocks=32)
    engine = llm.llm_engine
    real_schedule = engine.scheduler.schedule
    calls = []

    def schedule():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt   # as Ctrl-C would, between two steps
        return real_schedule()
    engine.scheduler.schedule = schedule
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hi", "Hello"], SamplingParams(max_tokens=8), use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.num_kv_blocks


def test_without_chunked_prefill_the_budget_must_hold_a_whole_context():
    """With max_model_len left to the model, only the engine knows it: it refuses to start rather than leave longer
    prompts waiting forever."""
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens .64. must be at least max_model_len .8192."):
        LLM(dtype="float32", enable_chunked_prefill=False, max_num_batched_tokens=64)
