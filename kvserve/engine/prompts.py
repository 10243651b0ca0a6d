"""Prompt inputs: text, token ids, or the dicts vLLM accepts; validated into (text, token_ids)."""
from __future__ import annotations

from typing import Union

from kvserve.errors import InvalidRequestError

PromptType = Union[str, list[int], dict]


def process_prompt(prompt: PromptType, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """Tokenize or check a prompt; raises InvalidRequestError saying what is wrong."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), check_token_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise InvalidRequestError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty; give at least one token of text", "prompt")
        check_text(prompt, "prompt")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, check_token_ids(prompt, vocab_size)
    raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}",
                              "prompt")


def check_token_ids(token_ids, vocab_size: int) -> list[int]:
    ids = list(token_ids)
    if not ids:
        raise InvalidRequestError("the prompt has no tokens; give at least one token id", "prompt")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(f"prompt token id {t!r} is not an integer in [0, {vocab_size})", "prompt")
    return ids


def check_text(text: str, param: str | None, where: str | None = None) -> None:
    """Raise InvalidRequestError if `text` is not Unicode text (a lone UTF-16 surrogate, as JSON's "\\ud800");
    the message names `where` it is (default: `param`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{where or param} has a lone UTF-16 surrogate at character {e.start}: not valid "
                                  "Unicode text", param) from None
