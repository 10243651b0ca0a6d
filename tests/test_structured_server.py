"""Structured outputs and tool calling over HTTP, end to end: the session `kvserve serve` process (bundled model,
conftest.py) driven by the official openai client and raw HTTP; tool_choice "auto" on Qwen2.5-Coder-0.5B with the
hermes parser when that GGUF has been fetched.

Outputs are judged against the constraint itself (the schema, the regex, the choices), never against a fixed text.
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_utils import API_KEY, MODEL, ServerProcess, post

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def matches(value, schema: dict) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 40), **kw)


def complete(client, **kw):
    return client.completions.create(model=MODEL, prompt=kw.pop("prompt", "My favourite colour is"), temperature=0,
                                     max_tokens=kw.pop("max_tokens", 16), **kw)


def stream_chat(server, body: dict) -> list[dict]:
    """The parsed chunks of a streamed chat completion."""
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 40, "stream": True, **body}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def reassemble(chunks: list[dict], index: int = 0) -> tuple[str | None, list[dict], str | None]:
    """Content, tool calls and finish_reason of one choice, put back together as a client does."""
    content, calls, finish = [], {}, None
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            for piece in delta.get("tool_calls") or []:
                if piece["index"] not in calls:
                    assert piece["id"].startswith("call_") and piece["type"] == "function"
                    calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in piece and "name" not in piece["function"]
                calls[piece["index"]]["arguments"] += piece["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


# ----- response_format -----
def test_response_format_json_object(client):
    r = chat(client, messages=[{"role": "user", "content": "Describe a cat as a JSON object with keys name and color."}],
             response_format={"type": "json_object"}, max_tokens=60)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_response_format_json_schema_on_chat_and_completions(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    answer = chat(client, messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt)
    text = complete(client, prompt="A person as JSON:", extra_body={"response_format": fmt}, max_tokens=40)
    for out, finish in ((answer.choices[0].message.content, answer.choices[0].finish_reason),
                        (text.choices[0].text, text.choices[0].finish_reason)):
        assert finish == "stop" and matches(json.loads(out), SCHEMA), out


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


def test_sdk_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, temperature=0, max_tokens=40)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and Person.model_validate_json(r.choices[0].message.content) == person


# ----- structured_outputs and vLLM's older guided_* fields -----
def test_structured_outputs_regex_choice_grammar_on_completions(client):
    regex = r"(red|green|blue), [0-9]{1,3}"
    out = complete(client, extra_body={"structured_outputs": {"regex": regex}}).choices[0]
    assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
    choices = ["sky blue", "grass green", "night black"]
    assert complete(client, extra_body={"structured_outputs": {"choice": choices}}).choices[0].text in choices
    grammar = 'root ::= "It is " number " degrees"\nnumber ::= [1-9] [0-9]?'
    out = complete(client, prompt="The temperature today:", extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"It is [1-9][0-9]? degrees", out.choices[0].text), out.choices[0].text


def test_structured_outputs_on_chat_streamed(server):
    chunks = stream_chat(server, {"structured_outputs": {"choice": ["yes", "no"]}, "n": 2, "temperature": 1.0,
                                  "seed": 3})
    for i in range(2):
        content, calls, finish = reassemble(chunks, i)
        assert content in ("yes", "no") and not calls and finish == "stop"


@pytest.mark.parametrize("alias, value, check", [
    ("guided_json", SCHEMA, lambda t: matches(json.loads(t), SCHEMA)),
    ("guided_regex", "[a-z]{3,8}!", lambda t: re.fullmatch("[a-z]{3,8}!", t)),
    ("guided_choice", ["left", "right"], lambda t: t in ("left", "right")),
    ("guided_grammar", 'root ::= "A" | "B"', lambda t: t in ("A", "B")),
])
def test_guided_aliases_constrain_like_structured_outputs(client, alias, value, check):
    out = complete(client, extra_body={alias: value}, max_tokens=40).choices[0]
    assert out.finish_reason == "stop" and check(out.text), out.text


# ----- tools -----
def arguments_match(call, tools=(WEATHER, TIME)) -> bool:
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    return matches(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice, n", [("required", 1),
                                            ({"type": "function", "function": {"name": "get_time"}}, 2)])
def test_tool_calls_whole_and_streamed(server, client, tool_choice, n):
    """The calls are well formed, match their tool's schema, and the streamed deltas add up to the same calls."""
    whole = chat(client, tools=[WEATHER, TIME], tool_choice=tool_choice, n=n)
    chunks = stream_chat(server, {"tools": [WEATHER, TIME], "tool_choice": tool_choice, "n": n})
    for choice in whole.choices:
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None and calls
        assert all(arguments_match(c) and c.id.startswith("call_") and c.type == "function" for c in calls)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in calls] == ["get_time"]
        content, streamed, finish = reassemble(chunks, choice.index)
        assert finish == "tool_calls" and content is None
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments)
                                                                   for c in calls]
    if isinstance(tool_choice, dict):   # a named call's arguments stream as they are generated
        pieces = [p for c in chunks for ch in c["choices"] for p in ch["delta"].get("tool_calls") or []]
        assert len([p for p in pieces if p["index"] == 0 and "id" not in p]) > 2 * n


def test_tool_choice_none_is_plain_text(client):
    r = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_follow_up_turn_with_tool_results(server, client):
    """An assistant turn with tool_calls (content null, arguments as JSON text or as the object some clients send)
    and the tool's answer are accepted back."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"}]
    r = chat(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 30
    call["function"]["arguments"] = {"city": "Paris", "unit": "celsius"}
    assert post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).status_code == 200


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def test_sdk_parse_with_a_pydantic_function_tool(client):
    tool = openai.pydantic_function_tool(GetWeather)
    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool], temperature=0, max_tokens=40,
                                      tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


# ----- bad input: a 400 with OpenAI's error body, on both endpoints, streamed or not -----
BAD_CONSTRAINTS = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a+"}}, "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    # these the engine finds, compiling the grammar
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}},
     "structured_outputs"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}}, "response_format"),
]
BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),   # auto, and this server has no --enable-auto-tool-choice
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": "f"}]}, "messages"),
]


def assert_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, param", BAD_CONSTRAINTS)
def test_bad_constraints_are_400_on_both_endpoints(server, fields, param, stream):
    for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": ASK})):
        assert_400(post(server, path, {**base, "max_tokens": 2, "stream": stream, **fields}), param)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, param", BAD_TOOLS)
def test_bad_tools_are_400(server, fields, param, stream):
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "stream": stream, **fields}),
               param)


# ----- tool_choice "auto": Qwen2.5-Coder-0.5B's own format, parsed by the hermes parser -----
@pytest.fixture(scope="module")
def qwen_client(qwen_05b_path):
    srv = ServerProcess(qwen_05b_path, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--max-model-len", "2048", "--kv-cache-memory", "64MiB", "--served-model-name", "qwen")
    try:
        srv.wait_ready()
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        srv.stop()


# the model's first token decides the call's form: on "What is the weather in Paris?" a bare object and a ```json
# fence (not a call) were 0.12 nats apart, which two CPUs' roundings ordered differently; this question's margin is
# 0.75 nats
QWEN_ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


def test_auto_tool_choice_parses_qwens_tool_call(qwen_client):
    r = qwen_client.chat.completions.create(model="qwen", messages=QWEN_ASK, tools=[WEATHER], temperature=0,
                                            max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    follow_up = QWEN_ASK + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees celsius"}]
    # the follow-up turn as Qwen's template renders it; Qwen's template writes the arguments with tojson: an object, not JSON text quoted again
    url = str(qwen_client.base_url).removesuffix("/v1/")
    ids = httpx.post(f"{url}/tokenize", json={"messages": follow_up}).json()["tokens"]
    prompt = httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f'"arguments": {call.function.arguments}' in prompt
    assert "<tool_response>\nSunny, 21 degrees celsius\n</tool_response>" in prompt
