"""Per-request constraints resolved when a request is admitted: bad words as the token sequences that write them,
the prompt's truncation, and a check that a request's allowed tokens leave it something to sample."""
from __future__ import annotations

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """Each bad word as the token sequences that write it (vLLM's rule): the word alone, and after a space (the
    form it takes inside a text) where that is another sequence of as many tokens starting with another token."""
    out: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if alone:
            out.append(alone)
        if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
            out.append(spaced)
    return out


def banned_by_bad_words(sequences: list[list[int]], output_token_ids: list[int]) -> set[int]:
    """The tokens a row may not sample next: the last token of each bad word whose other tokens end its output."""
    banned = set()
    for seq in sequences:
        n = len(seq) - 1
        if n <= len(output_token_ids) and (n == 0 or output_token_ids[-n:] == seq[:-1]):
            banned.add(seq[-1])
    return banned


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int, room: int, tokenizer) -> list[int]:
    """The prompt cut to `keep` tokens from its end (None: all; -1: as many as leave `room` tokens of the context
    for the output, max_model_len - room), keeping the special tokens its tokenizer puts first (BOS, [CLS]) where
    the prompt starts with them, as a tokenizer truncating from the left does."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len - room
    if keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens ({keep}) is more than max_model_len ({max_model_len})",
                                  "truncate_prompt_tokens")
    if len(token_ids) <= keep:
        return token_ids
    head = leading_special_tokens(tokenizer)
    if not head or token_ids[:len(head)] != head or keep <= len(head):
        return token_ids[-keep:]
    return head + token_ids[len(token_ids) - (keep - len(head)):]


def leading_special_tokens(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (BOS, [CLS]; none for many)."""
    with_special = tokenizer.encode("a", add_special_tokens=True)
    plain = tokenizer.encode("a", add_special_tokens=False)
    if not plain:
        return []
    at = next((i for i in range(len(with_special)) if with_special[i:i + len(plain)] == plain), 0)
    return with_special[:at]


def check_allowed_tokens(params: SamplingParams, eos_token_ids: set[int]) -> None:
    """A request whose allowed tokens are all bad words (of one token), or all stop tokens while min_tokens forbids
    them, has nothing to sample: refused."""
    if params.allowed_token_ids is None:
        return
    usable = set(params.allowed_token_ids) - banned_by_bad_words(params.bad_words_token_ids, [])   # one-token words
    if params.min_tokens:
        usable -= set(eos_token_ids) | params.all_stop_token_ids
    if not usable:
        raise InvalidRequestError("allowed_token_ids leaves nothing to sample: each is a bad word, or a stop token "
                                  "that min_tokens forbids", "allowed_token_ids")
