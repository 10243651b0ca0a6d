"""Tool-call parsers for tool_choice "auto" (vLLM's --tool-call-parser names): model text in, content and calls out.

Each parser knows one model family's format. `extract` parses a whole output; `num_content_chars` says how much of a
partial output is surely content, so a stream can send that much before the calls (if any) are complete.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class ParsedToolCall:
    """One call found in the text: a function name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """What a parser found: the content the user sees (None when empty) and the calls."""

    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser:
    """Base of the parsers: text that does not parse stays content. `tool_names`: the request's functions."""

    name = ""

    def __init__(self, tool_names: set[str] | None = None):
        self.tool_names = tool_names or set()

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and the tool calls of a complete output."""
        raise NotImplementedError

    def num_content_chars(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever comes next."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5: text, then one or more `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
    Small Qwen models often drop the tags: an output that is nothing but such an object, naming one of the
    request's tools, is a call too."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(self.start)
        if first < 0:
            return self._bare_call(text)
        calls = []
        for block in text[first:].split(self.start)[1:]:
            # an unclosed last block (the output ran out at </tool_call>) is still parsed: its JSON may be whole
            call = _call_from_json(block.split(self.end)[0], "arguments")
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
        return ExtractedToolCalls(text[:first] or None, calls)

    def _bare_call(self, text: str) -> ExtractedToolCalls:
        call = _call_from_json(text, "arguments") if text.lstrip().startswith("{") else None
        if call is None or call.name not in self.tool_names:
            return ExtractedToolCalls(text or None)
        return ExtractedToolCalls(None, [call])

    def num_content_chars(self, text: str) -> int:
        first = text.find(self.start)
        if first >= 0:
            return first
        if not text.strip() or text.lstrip().startswith("{"):
            return 0   # may be a bare call: hold it back until the output is complete
        return len(text) - _partial_suffix(text, self.start)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, maybe after <|python_tag|>, several joined by
    `;`. Only an output that starts with a call is one (as vLLM's llama3_json)."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.lstrip().removeprefix(self.tag).lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text or None)
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return ExtractedToolCalls(text)
            # the arguments key must be there: a plain JSON answer with a "name" field is no call
            key = next((k for k in ("parameters", "arguments") if isinstance(obj, dict) and k in obj), None)
            call = call_from_obj(obj, key) if key else None
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
            pos = _skip_separator(body, pos)
        return ExtractedToolCalls(None, calls)

    def num_content_chars(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith(("{", self.tag)) or self.tag.startswith(head):
            return 0   # may be a call: hold it back until the output is complete
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def _call_from_json(text: str, args_key: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return call_from_obj(obj, args_key)


def call_from_obj(obj, args_key: str) -> ParsedToolCall | None:
    """A call from {"name": str, args_key: object}; None when the object is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, {})
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _skip_separator(body: str, pos: int) -> int:
    """Past whitespace and at most one `;` between two calls."""
    while pos < len(body) and body[pos].isspace():
        pos += 1
    if pos < len(body) and body[pos] == ";":
        pos += 1
    while pos < len(body) and body[pos].isspace():
        pos += 1
    return pos


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (a marker the next tokens may complete)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
