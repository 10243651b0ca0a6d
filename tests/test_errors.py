"""Every bad input gets a typed error that says what is wrong, and nothing else is disturbed."""
import pytest

from kvserve import (LLM, ContextLengthExceededError, EngineConfig, InvalidRequestError, ModelLoadError,
                     SamplingParams)


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
])
def test_bad_sampling_params(kwargs, param, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and words in str(e.value)


def test_bad_engine_config():
    with pytest.raises(InvalidRequestError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(InvalidRequestError, match="memory size"):
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


def test_request_larger_than_the_whole_kv_pool():
    small = LLM(dtype="float32", max_model_len=512, num_kv_blocks=4, block_size=16)
    with pytest.raises(ContextLengthExceededError, match="whole KV cache"):
        small.generate({"prompt_token_ids": [1] * 40}, SamplingParams(max_tokens=40), use_tqdm=False)


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
