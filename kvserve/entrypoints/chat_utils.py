"""Chat templates: a conversation (OpenAI-style messages) rendered to prompt token ids, shared by LLM and the server."""
from __future__ import annotations

from typing import Any

from kvserve.engine.prompts import check_text
from kvserve.errors import InvalidRequestError

Conversation = list[dict[str, Any]]


def apply_chat_template(tokenizer, conversation: Conversation, chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation rendered with the given template, else the tokenizer's own."""
    return tokenizer.encode(render_chat(tokenizer, conversation, chat_template, add_generation_prompt,
                                        continue_final_message, chat_template_kwargs), add_special_tokens=False)


def render_chat(tokenizer, conversation: Conversation, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None) -> str:
    """The prompt text of a conversation; raises InvalidRequestError naming what is wrong."""
    template = chat_template or tokenizer.chat_template
    if template is None:
        raise InvalidRequestError("this model has no chat template; pass chat_template", "chat_template")
    messages = normalize_messages(conversation)
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise InvalidRequestError("continue_final_message needs the last message to be an assistant message",
                                  "messages")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message"):
        if reserved in kwargs:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved!r}", "chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt and not continue_final_message,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # jinja errors: the template rejected the conversation
        raise InvalidRequestError(f"the chat template failed on these messages: {e}", "messages") from e


def normalize_messages(conversation: Conversation) -> Conversation:
    """Messages with string content: a list of text parts is joined, None becomes ''."""
    if not isinstance(conversation, list) or not conversation:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts",
                                  "messages")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be a dict with a string 'role'", "messages")
        out.append({**message, "content": _text_content(message.get("content"), i)})
    return out


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
