"""Tool calling without a model: the parsers on text, tool validation, the required schema, and the deltas a choice
streams (whole and piecewise feeds must add up to the same message)."""
from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.openai.errors import BadRequestError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.structured import check_json_schema
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser, \
    ParsedToolCall
from kvserve.entrypoints.openai.tools import ToolCallStream, assemble, parse_required, required_schema, \
    resolve_tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def call(name: str, **args) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(args))


# ----- hermes (Qwen2.5) -----
def test_hermes_one_call_with_text_before():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    found = HermesToolParser().extract(text)
    assert found.content == "Let me check.\n" and found.calls == [call("get_weather", city="Paris")]


def test_hermes_several_calls_and_an_unclosed_last_one():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}')
    found = HermesToolParser().extract(text)
    assert found.content is None and found.calls == [call("get_weather", city="Paris"), call("get_time")]


@pytest.mark.parametrize("text", ["Paris is sunny.", "<tool_call>\n{not json}\n</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'])
def test_hermes_text_that_does_not_parse_stays_content(text):
    found = HermesToolParser().extract(text)
    assert found.content == text and found.calls == []


def test_hermes_a_bare_call_of_a_known_tool_is_a_call():
    # what Qwen2.5-Coder-0.5B answers: the object without its <tool_call> tags
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert HermesToolParser({"get_weather"}).extract(text).calls == [call("get_weather", city="Paris")]
    for parser, text in ((HermesToolParser({"get_time"}), text), (HermesToolParser({"get_weather"}), text + " ok")):
        assert parser.extract(text).content == text and parser.extract(text).calls == []


def test_hermes_holds_back_only_what_may_start_a_call():
    p = HermesToolParser()
    assert p.num_content_chars("Hello") == 5
    assert p.num_content_chars("Hello <tool") == len("Hello ")
    assert p.num_content_chars("a < b") == 5
    assert p.num_content_chars("Hi <tool_call>\n{") == 3
    assert p.num_content_chars(' {"name') == 0 and p.num_content_chars("\n") == 0


# ----- llama3_json -----
@pytest.mark.parametrize("text", ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
                                  '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                                  '  {"name": "get_weather", "arguments": {"city": "Paris"}}'])
def test_llama3_json_one_call(text):
    found = Llama3JsonToolParser().extract(text)
    assert found.content is None and found.calls == [call("get_weather", city="Paris")]


def test_llama3_json_calls_separated_by_semicolons():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    assert Llama3JsonToolParser().extract(text).calls == [call("get_weather", city="Paris"), call("get_time")]


@pytest.mark.parametrize("text", ["The weather is fine.", '{"name": "Bob", "age": 3}',
                                  '{"name": "get_time", "parameters": {}} and then some text',
                                  '{"name": "get_time", "parameters": {'])
def test_llama3_json_text_that_does_not_parse_stays_content(text):
    found = Llama3JsonToolParser().extract(text)
    assert found.content == text and found.calls == []


def test_llama3_json_holds_back_a_possible_call():
    p = Llama3JsonToolParser()
    assert p.num_content_chars("  ") == 0 and p.num_content_chars("<|python") == 0
    assert p.num_content_chars('{"na') == 0 and p.num_content_chars("Sure, ") == len("Sure, ")


def test_cli_offers_every_parser():
    from kvserve.entrypoints.cli import build_parser
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"


def test_serve_refuses_auto_tool_choice_without_a_parser(capsys):
    from kvserve.entrypoints.cli import main
    # a missing model: were the flags not checked first, this would fail on loading it, saying something else
    assert main(["serve", "/nonexistent.gguf", "--enable-auto-tool-choice"]) == 1
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


# ----- tools and tool_choice -----
def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("tools, words", [
    ([{"type": "retrieval", "function": {"name": "f"}}], "type must be 'function'"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "letters, digits"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "1 to 64"),
    ([TIME, TIME], "two functions named 'get_time'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "parameters.type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": 3}}}}],
     "parameters.properties.a"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}], "required"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "must be an object schema"),
])
def test_bad_tools_are_400_naming_tools(tools, words):
    with pytest.raises(BadRequestError) as e:
        resolve_tool_choice(request(tools=tools, tool_choice="required"), None, False)
    assert e.value.param == "tools" and words in e.value.message


@pytest.mark.parametrize("fields, words", [
    ({"tool_choice": "auto"}, "tool_choice needs tools"),
    ({"tools": [TIME], "tool_choice": "always"}, "'none', 'auto', 'required'"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [TIME], "tool_choice": {"type": "function"}}, "'function': {'name'"),
    ({"tools": [TIME]}, "--enable-auto-tool-choice and --tool-call-parser"),
])
def test_bad_tool_choice_is_400_naming_tool_choice(fields, words):
    with pytest.raises(BadRequestError) as e:
        resolve_tool_choice(request(**fields), None, False)
    assert e.value.param == "tool_choice" and words in e.value.message


def test_tool_choice_modes_and_their_constraints():
    named = resolve_tool_choice(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                            "function": {"name": "get_weather"}}),
                                None, False)
    assert named.mode == "named" and named.constraint().json == WEATHER["function"]["parameters"]
    required = resolve_tool_choice(request(tools=[WEATHER, TIME], tool_choice="required"), None, False)
    assert required.constraint().json == required_schema(required.tools, True)
    assert resolve_tool_choice(request(tools=[TIME], tool_choice="none"), None, False).constraint() is None
    auto = resolve_tool_choice(request(tools=[TIME]), "hermes", True)
    assert auto.mode == "auto" and isinstance(auto.parser, HermesToolParser) and auto.constraint() is None
    assert resolve_tool_choice(request(), "hermes", True) is None


def test_required_schema_is_vllms_shape():
    schema = required_schema([WEATHER, TIME], parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    weather, time = schema["items"]["anyOf"]
    assert weather == {"properties": {"name": {"const": "get_weather"},
                                      "parameters": WEATHER["function"]["parameters"]},
                       "required": ["name", "parameters"]}
    assert time["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in required_schema([TIME], parallel=True)


def test_parse_required():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    assert parse_required(text) == [call("get_weather", city="Paris"), call("get_time")]
    assert parse_required('[{"name": "get_weather", "parameters": {"ci') is None
    assert parse_required("[]") is None


def test_json_schema_check_accepts_real_schemas():
    from pydantic import BaseModel

    class Item(BaseModel):
        name: str
        tags: list[str] = []

    class Order(BaseModel):
        items: list[Item]
        note: str | None = None

    check_json_schema(Order.model_json_schema(), "tools", "parameters")
    check_json_schema({"type": ["string", "null"], "pattern": r"^\p{L}+$", "x-custom": 1}, "tools", "p")
    with pytest.raises(BadRequestError):
        check_json_schema([], "tools", "parameters")


# ----- the deltas of a choice -----
def stream_in_pieces(choice, text: str, size: int = 3) -> list:
    s = ToolCallStream(choice)
    deltas = []
    for i in range(0, len(text), size):
        deltas += s.feed(text[i:i + size], i + size >= len(text))
    return deltas, s


@pytest.mark.parametrize("mode, text", [
    ("auto-hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("auto-hermes", "No call here, a < b and <tool but nothing more."),
    ("auto-llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'),
    ("required", '[{"name": "get_weather", "param'),
    ("named", '{"city": "Paris"}'),
    ("none", "Just text."),
])
def test_streamed_deltas_add_up_to_the_whole_answer(mode, text):
    fields = {"tools": [WEATHER, TIME], "tool_choice": mode.split("-")[0]}
    if mode == "named":
        fields["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    parser = mode.split("-")[1] if "-" in mode else None
    choice = resolve_tool_choice(request(**fields), parser, True)
    whole = ToolCallStream(choice)
    content, calls = assemble(whole.feed(text, True))
    deltas, piecewise = stream_in_pieces(choice, text)
    streamed_content, streamed_calls = assemble(deltas)
    assert streamed_content == content
    assert [c.function for c in streamed_calls or []] == [c.function for c in calls or []]
    assert piecewise.finish_reason("stop") == whole.finish_reason("stop")
    if calls:
        assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
        assert all(c.id.startswith("call_") for c in calls)
        # the first piece of each call carries its id, type and name; later ones only arguments
        firsts = [d.tool_calls[0] for d in deltas if d.tool_calls and d.tool_calls[0].id]
        assert [f.function.name for f in firsts] == [c.function.name for c in calls]
    else:
        assert content == text and whole.finish_reason("stop") == "stop"


def test_auto_streams_content_before_the_call_as_it_comes():
    choice = resolve_tool_choice(request(tools=[WEATHER]), "hermes", True)
    s = ToolCallStream(choice)
    assert [d.content for d in s.feed("Let me ", False)] == ["Let me "]
    assert [d.content for d in s.feed("check <tool", False)] == ["check "]
    assert s.feed('_call>\n{"name": "get_weather", ', False) == []
    last = s.feed('"arguments": {"city": "Rome"}}\n</tool_call>', True)
    assert [d.tool_calls[0].function.name for d in last] == ["get_weather"]


def test_named_streams_arguments_as_they_come():
    choice = resolve_tool_choice(request(tools=[WEATHER], tool_choice={"type": "function",
                                                                      "function": {"name": "get_weather"}}), None, False)
    s = ToolCallStream(choice)
    first = s.feed('{"ci', False)
    assert first[0].tool_calls[0].function.name == "get_weather" and first[0].tool_calls[0].function.arguments == ""
    assert first[1].tool_calls[0].function.arguments == '{"ci' and first[1].tool_calls[0].id is None
    assert s.feed('ty": "Oslo"}', True)[0].tool_calls[0].function.arguments == 'ty": "Oslo"}'


def test_parallel_tool_calls_false_keeps_one_auto_call():
    choice = resolve_tool_choice(request(tools=[WEATHER, TIME], parallel_tool_calls=False), "llama3_json", True)
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    _, calls = assemble(ToolCallStream(choice).feed(text, True))
    assert [c.function.name for c in calls] == ["get_weather"]


# ----- the chat template's view: tools, and earlier tool calls with their arguments as objects -----
TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
            "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")


def tiny_tokenizer():
    """An HF tokenizer with a one-word vocabulary: apply_chat_template (HF's Jinja environment) without a model."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))


def test_the_template_gets_tools_and_decoded_arguments():
    from kvserve.entrypoints.chat_utils import render_chat
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = render_chat(tiny_tokenizer(), messages, TEMPLATE, add_generation_prompt=False,
                       tools=[WEATHER, TIME])
    assert text == ('[tool get_weather][tool get_time]<user>Weather?<assistant>get_weather{"city": "Paris"}'
                    "<tool>sunny#call_1")


@pytest.mark.parametrize("tool_calls, words", [
    ("f", "must be a list"), ([{"function": "f"}], "'function': {'name'"),
    ([{"function": {"name": "f", "arguments": "{oops"}}], "not valid JSON"),
    ([{"function": {"name": "f", "arguments": "[1]"}}], "a JSON object"),
    ([{"function": {"name": "f", "arguments": "[" * 100000}}], "not valid JSON"),
])
def test_bad_tool_calls_in_messages_name_messages(tool_calls, words):
    from kvserve.entrypoints.chat_utils import normalize_messages
    from kvserve.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError) as e:
        normalize_messages([{"role": "assistant", "tool_calls": tool_calls}])
    assert e.value.param == "messages" and words in e.value.message
