"""Chat templates: a conversation (OpenAI-style messages) rendered to prompt token ids, shared by LLM and the server."""
from __future__ import annotations

import json
from typing import Any

from kvserve.engine.prompts import check_text
from kvserve.errors import InvalidRequestError

Conversation = list[dict[str, Any]]


def apply_chat_template(tokenizer, conversation: Conversation, chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation rendered with the given template, else the tokenizer's own."""
    return tokenizer.encode(render_chat(tokenizer, conversation, chat_template, add_generation_prompt,
                                        continue_final_message, chat_template_kwargs, tools), add_special_tokens=False)


def render_chat(tokenizer, conversation: Conversation, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation (tools: OpenAI tool dicts, for templates that list them to the model);
    raises InvalidRequestError naming what is wrong."""
    template = chat_template or tokenizer.chat_template
    if template is None:
        raise InvalidRequestError("this model has no chat template; pass chat_template", "chat_template")
    messages = normalize_messages(conversation)
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise InvalidRequestError("continue_final_message needs the last message to be an assistant message",
                                  "messages")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
                     "tools"):
        if reserved in kwargs:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved!r}", "chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt and not continue_final_message,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # jinja errors: the template rejected the conversation
        raise InvalidRequestError(f"the chat template failed on these messages: {e}", "messages") from e


def normalize_messages(conversation: Conversation) -> Conversation:
    """Messages with string content (a list of text parts is joined, None becomes ''), and tool calls' arguments
    as objects: templates (Qwen's) write them with `tojson`, which would quote JSON text a second time."""
    if not isinstance(conversation, list) or not conversation:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts",
                                  "messages")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be a dict with a string 'role'", "messages")
        out.append({**message, "content": _text_content(message.get("content"), i)})
        if message.get("tool_calls") is not None:
            out[-1]["tool_calls"] = _tool_calls(message["tool_calls"], i)
    return out


def _tool_calls(calls: Any, index: int) -> list[dict]:
    """An assistant message's tool calls, each function's arguments decoded from JSON text to an object."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list of tool calls", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name': ..., "
                                      "'arguments': ...}}", "messages")
        out.append({**call, "function": {**fn, "arguments": _arguments(fn.get("arguments"), f"{where}[{j}]")}})
    return out


def _arguments(arguments: Any, where: str) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as e:   # RecursionError: nested too deeply to decode
            raise InvalidRequestError(f"{where}.function.arguments is not valid JSON: {e}", "messages") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON object", "messages")
    return arguments


def _text_content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        check_text(content, f"messages[{index}].content")
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{index}].content: only text parts "
                                          "({'type': 'text', 'text': ...}) are supported", "messages")
            check_text(part["text"], f"messages[{index}].content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts", "messages")
