"""The server's answers to bad input, keys and oversized bodies, on the shared `kvserve serve` process (conftest.py):
a 4xx with OpenAI's error body naming the field, never a 500, and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_utils import API_KEY, MAX_MODEL_LEN, MODEL, post, wait_idle

pytestmark = pytest.mark.slow


def test_error_malformed_json_and_wrong_types(server):
    for body, param in (("{not json", None), ('["a list"]', None), ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
                        ({"prompt": 3}, "prompt"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
                        ({"max_tokens": 3}, "prompt")):
        r = post(server, "/v1/completions", body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param, r.text
        assert err["message"]
    r = post(server, "/v1/chat/completions", {"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_error_in_one_prompt_of_a_list_queues_none(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[[1, 2, 3], [10**7]], max_tokens=50)
    assert e.value.body["message"].startswith("prompt 1: ") and e.value.body["param"] == "prompt"
    wait_idle(server, timeout_s=5)


def test_error_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0),
                                         ("presence_penalty", 3.0), ("logprobs", 50), ("seed", 2**80),
                                         ("seed", -2**63 - 1), ("n", 33)])
def test_error_out_of_range_is_400(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", **{"max_tokens": 2, field: value})
    assert e.value.body["param"] == field and str(value) in e.value.body["message"]


def test_error_prompt_over_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[7] * MAX_MODEL_LEN, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=MAX_MODEL_LEN)
    assert e.value.body["param"] == "max_tokens"


def test_error_missing_or_wrong_api_key_is_401(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/completions", {"prompt": "x"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_admin_and_utility_routes_need_the_key_probes_do_not(server):
    for path, body in (("/reset_prefix_cache", {}), ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        for key in (None, "wrong"):
            r = post(server, path, body, key=key)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, key)
        assert post(server, path, body).status_code in (200, 409), path   # 409: cache busy
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}").status_code == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path


RAW_BAD_BODIES = [
    ('{"prompt": "\\ud800 hi", "max_tokens": 2}', "prompt", "surrogate"),
    ('{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]", "surrogate"),
    ('{"prompt": "x", "max_tokens": 2, "temperature": NaN}', None, "NaN"),
    ('{"prompt": "x", "max_tokens": 2, "top_p": Infinity}', None, "Infinity"),
    ('{"prompt": "x", "max_tokens": 2, "presence_penalty": -Infinity}', None, "Infinity"),
    ('{"prompt": "x", "stop": ' + "[" * 5000 + "]" * 5000 + "}", None, "nested too deeply"),
    ('{"prompt": "x", "user": ' + "[" * 100 + "]" * 100 + "}", "user", "nested too deeply"),
    ('{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias", "token ids"),
    ('{"prompt": "x", "logit_bias": {"\\udc00": 1}}', "logit_bias", "a key of logit_bias has a lone UTF-16 surrogate"),
]


@pytest.mark.parametrize("body,param,words", RAW_BAD_BODIES)
def test_error_bodies_json_accepts_but_no_field_may_hold_are_400(server, body, param, words):
    r = post(server, "/v1/completions", body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param, r.text
    assert words in err["message"]


@pytest.mark.parametrize("messages", [
    [], [{"role": "user"}], [{"content": "no role"}], [{"role": 5, "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": {"text": "x"}}],
    [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
    [{"role": "", "content": "x"}], [{"role": "tool", "content": "x"}], [{"role": "developer", "content": "x"}],
    [{"role": "assistant", "content": None}], [{"role": "user", "content": "x", "name": 3}],
])
def test_odd_chat_messages_are_answered_never_a_500(server, messages):
    body = json.dumps({"messages": messages, "max_tokens": 2})   # lone surrogates go out as JSON escapes
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["message"]


def test_body_over_the_size_limit_is_413_before_it_is_read(server):
    limit = (4 << 20) + 32 * MAX_MODEL_LEN
    big = json.dumps({"prompt": "x" * (limit + 10), "max_tokens": 1})
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks():   # no Content-Length: read only up to the limit
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 413 and "request_too_large" in r.text
    r = post(server, "/v1/completions", json.dumps({"prompt": "x" * 1000, "max_tokens": 1}))
    assert r.status_code == 200   # under the limit: served as usual


def test_models_retrieve_and_its_404(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]


def test_openai_refusals_name_the_field_the_request_used(client):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=0)
    assert e.value.body["param"] == "max_completion_tokens" and "max_completion_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_MODEL_LEN)
    assert e.value.body["param"] == "max_completion_tokens"
    for create, kwargs in ((client.chat.completions.create, {"messages": messages}),
                           (client.completions.create, {"prompt": "Hi"})):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=2, stream_options={"include_usage": True}, **kwargs)
        assert e.value.body["param"] == "stream_options"
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answered = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    assert client.chat.completions.create(model=MODEL, messages=answered, max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            *answered, {"role": "tool", "tool_call_id": "call_2", "content": "43"}])
    assert e.value.body["param"] == "messages[3].tool_call_id" and "call_2" in e.value.body["message"]


def test_vllm_sampling_extras_work_and_their_bad_values_are_400(server, client):
    """allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's extra fields) do what they say through the
    server, and a bad value of each is a 400 naming it."""
    paris = post(server, "/tokenize", {"model": MODEL, "prompt": " Paris", "add_special_tokens": False}).json()
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                    extra_body={"allowed_token_ids": paris["tokens"], "ignore_eos": True})
    assert out.choices[0].text == " Paris" * 3
    free = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    banned = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       extra_body={"bad_words": ["Paris"]})
    assert "Paris" in free.choices[0].text and "Paris" not in banned.choices[0].text
    cut = client.completions.create(model=MODEL, prompt=[7] * MAX_MODEL_LEN, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 8})
    assert cut.usage.prompt_tokens == 8
    text = "one two three four five six seven"
    echo = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0, echo=True, logprobs=0,
                                     extra_body={"truncate_prompt_tokens": 3})
    ids = post(server, "/tokenize", {"model": MODEL, "prompt": text}).json()["tokens"][-3:]
    kept = post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json()["prompt"]
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(kept) and "".join(lp.tokens[:3]) == kept
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    for field, value in (("allowed_token_ids", []), ("bad_words", [""]), ("truncate_prompt_tokens", 0)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field
