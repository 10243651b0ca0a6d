"""Tool calling on chat completions: a request's tools and tool_choice checked, the constraint they imply, and the
model's output turned into tool calls, streamed or whole (both built from the same deltas, so they agree)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvserve.entrypoints.openai.errors import BadRequestError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, DeltaFunctionCall, DeltaMessage, \
    DeltaToolCall, FunctionCall, ToolCall, random_id
from kvserve.entrypoints.openai.structured import check_json_schema
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedToolCall, ToolParser, call_from_obj
from kvserve.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
AUTO_FLAGS_MESSAGE = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                      f"(parsers: {', '.join(TOOL_PARSERS)})")


@dataclass
class ToolChoice:
    """How one request uses its tools: mode is none, auto, required or named (a forced function)."""

    mode: str
    tools: list[dict]              # as the chat template receives them (HF's apply_chat_template(tools=...))
    name: str | None = None        # the forced function of mode "named"
    parallel: bool = True          # parallel_tool_calls
    parser: ToolParser | None = None   # mode "auto"

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint of the mode: required and named calls are decoded against a schema, as compact
        JSON (arguments are data for a program: free whitespace only costs tokens, and small models loop on it)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._tool(self.name)), disable_any_whitespace=True)
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel),
                                           disable_any_whitespace=True)
        return None

    def _tool(self, name: str) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)


def resolve_tool_choice(req: ChatCompletionRequest, tool_call_parser: str | None,
                        enable_auto_tool_choice: bool) -> ToolChoice | None:
    """The request's ToolChoice (None without tools); 400 naming tools or tool_choice when they are wrong."""
    if not req.tools:
        if req.tool_choice is not None:
            raise BadRequestError("tool_choice needs tools", "tool_choice", "invalid_value")
        return None
    tools = check_tools(req)
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, dict):
        return ToolChoice("named", tools, _named_function(choice, tools), parallel=False)
    if choice not in ("none", "auto", "required"):
        raise BadRequestError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                              f"'function': {{'name': ...}}}}, got {choice!r}", "tool_choice", "invalid_value")
    if choice != "auto":
        return ToolChoice(choice, tools, parallel=parallel)
    if not (enable_auto_tool_choice and tool_call_parser):
        raise BadRequestError(AUTO_FLAGS_MESSAGE, "tool_choice", "invalid_value")
    parser = TOOL_PARSERS[tool_call_parser]({t["function"]["name"] for t in tools})
    return ToolChoice("auto", tools, parallel=parallel, parser=parser)


def check_tools(req: ChatCompletionRequest) -> list[dict]:
    """The tools as plain dicts; 400 naming tools unless each is a function with a good name and schema."""
    seen: set[str] = set()
    for i, tool in enumerate(req.tools):
        fn = tool.function
        if tool.type != "function":
            raise BadRequestError(f"tools[{i}].type must be 'function', got {tool.type!r}", "tools", "invalid_value")
        if not _NAME.fullmatch(fn.name):
            raise BadRequestError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', got "
                                  f"{fn.name!r}", "tools", "invalid_value")
        if fn.name in seen:
            raise BadRequestError(f"tools has two functions named {fn.name!r}", "tools", "invalid_value")
        seen.add(fn.name)
        if fn.parameters is not None:
            check_json_schema(fn.parameters, "tools", f"tools[{i}].function.parameters")
            if not isinstance(fn.parameters, dict) or fn.parameters.get("type", "object") != "object":
                # a call's arguments are a JSON object
                raise BadRequestError(f"tools[{i}].function.parameters must be an object schema "
                                      f"(\"type\": \"object\"), got type {fn.parameters.get('type')!r}", "tools",
                                      "invalid_value")
    return [tool.model_dump(exclude_none=True) for tool in req.tools]


def _named_function(choice: dict, tools: list[dict]) -> str:
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                              "tool_choice", "invalid_value")
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise BadRequestError(f"tool_choice names the function {fn['name']!r}, which is not in tools", "tool_choice",
                              "invalid_value")
    return fn["name"]


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's schema for tool_choice "required": a list of {"name", "parameters"} calls of the given tools."""
    calls = [{"properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[ParsedToolCall] | None:
    """The calls of a tool_choice "required" output; None when it is not a list of calls (it ran out of tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [call_from_obj(item, "parameters") for item in items]
    return None if any(c is None for c in calls) else calls


class ToolCallStream:
    """One choice's output as deltas: content, tool-call pieces, or both. Fed the new text of each engine output."""

    def __init__(self, choice: ToolChoice | None):
        self.choice = choice
        self.text = ""        # everything generated so far
        self.num_sent = 0     # leading characters of text already sent as content
        self.num_calls = 0

    def feed(self, text: str, done: bool) -> list[DeltaMessage]:
        """The deltas to send after `text` (the output's new text); `done`: the output is complete."""
        self.text += text
        if self.choice is None or self.choice.mode == "none":
            return [DeltaMessage(content=text)] if text else []
        if self.choice.mode == "named":
            return self._named(text)
        if not done:
            # auto: send what surely is content; required: a call is sent once the whole list has parsed
            return self._content_upto(self.choice.parser.num_content_chars(self.text)) if self.choice.parser else []
        return self._finish()

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools."""
        return "tool_calls" if self.num_calls and engine_reason == "stop" else engine_reason

    def _named(self, text: str) -> list[DeltaMessage]:
        # the forced function's arguments are the whole output: stream them as they come
        out = [] if self.num_calls else [self._call(self.choice.name, "")]
        if text:
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]))
        return out

    def _finish(self) -> list[DeltaMessage]:
        if self.choice.mode == "required":
            calls, content = parse_required(self.text), None
        else:
            found = self.choice.parser.extract(self.text)
            calls, content = found.calls or None, found.content
        if not calls:
            return self._content_upto(len(self.text))
        if not self.choice.parallel:
            calls = calls[:1]
        return self._content_upto(len(content or "")) + [self._call(c.name, c.arguments) for c in calls]

    def _content_upto(self, end: int) -> list[DeltaMessage]:
        if end <= self.num_sent:
            return []
        delta = DeltaMessage(content=self.text[self.num_sent:end])
        self.num_sent = end
        return [delta]

    def _call(self, name: str, arguments: str) -> DeltaMessage:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=f"call_{random_id()[:24]}", type="function",
                                                      function=DeltaFunctionCall(name=name, arguments=arguments))])


def assemble(deltas: list[DeltaMessage]) -> tuple[str | None, list[ToolCall] | None]:
    """The message content and tool calls that a list of deltas adds up to (what a client reassembles)."""
    content = [d.content for d in deltas if d.content is not None]
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for piece in d.tool_calls or []:
            if piece.index not in calls:
                calls[piece.index] = ToolCall(id=piece.id, function=FunctionCall(name=piece.function.name,
                                                                                 arguments=""))
            calls[piece.index].function.arguments += piece.function.arguments or ""
    if not calls:
        return "".join(content), None
    return "".join(content) or None, [calls[i] for i in sorted(calls)]
