"""Incremental detokenization and stop strings: one sequence's token ids in, its text and stop string out.

Each new token is decoded inside a small window of ids, never the whole sequence (vLLM's prefix/read offsets):

    window:   [ context .......... | pending ........... ]
               prefix_offset         read_offset          end
    text:     decode(window) = prefix_text + new_text

`prefix_text` (the decode of the context) was already emitted, or belongs to the prompt. `new_text` is emitted once
it no longer ends in U+FFFD, i.e. once its last character is complete; the window then slides to start at the old
read offset, so the decoder still sees the token before the new ones (sentencepiece decoders need it for spaces).
"""
from __future__ import annotations

import io
from collections.abc import Callable, Iterable

from tokenizers import decoders

from kvserve.outputs import Logprob
from kvserve.sampling_params import RequestOutputKind, SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the output as context (vLLM uses 5 too).
_NUM_CONTEXT_TOKENS = 5
# A stall longer than this (text still ending in U+FFFD) is split at a settled point, so that a long run of
# undecodable bytes cannot make the window, and with it the per-token cost, grow.
_MAX_PENDING_TOKENS = 6
# An incomplete UTF-8 character has at most 3 bytes, so a settled split point lies among the last few tokens.
_NUM_SPLIT_CANDIDATES = 4


def make_decode_fn(tokenizer, skip_special_tokens: bool = False,
                   spaces_between_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """Returns ids -> text, as `tokenizer.decode` does it but without clean-up of spaces (it is not incremental).

    A fast tokenizer decodes through its Rust backend directly; like `tokenizer.decode`, it puts nothing between
    special tokens, so `spaces_between_special_tokens` only matters to slow tokenizers.
    """
    backend = _backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        spaces_between_special_tokens=spaces_between_special_tokens,
                                        clean_up_tokenization_spaces=False)


def _backend(tokenizer):
    """The Rust tokenizer that decodes for `tokenizer`: a fast tokenizer's, or a bare tokenizers.Tokenizer; None for a
    slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None and hasattr(tokenizer, "decode_batch"):   # a bare tokenizers.Tokenizer
        backend = tokenizer
    return backend


def decodes_bytes_at_once(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE's (GPT-2, Llama 3, Qwen, SmolLM2), which turns the bytes of
    all its tokens into text in one pass: then decoding a sequence at once gives what the window's steps add up to
    (tests/test_detokenizer.py tries random ids). Byte-fallback decoders (Llama 2, Gemma) turn a run of byte tokens
    that is not valid UTF-8 into one U+FFFD per byte, so a complete character the window emitted can decode
    otherwise once more bytes follow it."""
    backend = _backend(tokenizer)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


def detokenize_logprobs(tokenizer, logprobs: Iterable[dict[int, Logprob] | None]) -> None:
    """Fills in `decoded_token` of every Logprob (sampled or prompt logprobs) that has none yet, in place."""
    decode = make_decode_fn(tokenizer)
    for position in logprobs:
        for token_id, logprob in (position or {}).items():
            if logprob.decoded_token is None:
                logprob.decoded_token = decode([token_id])


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text a few at a time and finds its stop strings."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.num_output_tokens = 0
        self.stop = list(params.stop) if params.detokenize else []
        self._max_stop_len = max(map(len, self.stop), default=0)
        # Chars held back while streaming, so that the start of a stop string is never emitted and then retracted;
        # when the stop string is kept in the output nothing is ever retracted.
        self.stop_buffer_length = 0 if params.include_stop_str_in_output else max(self._max_stop_len - 1, 0)
        self._text = io.StringIO()   # appends, reads and cuts near the end cost O(their size), not O(length)
        self._num_chars = 0
        self._num_emitted_chars = 0  # how much get_next_output_text(delta=True) has handed out
        self._is_stopped = False     # a stop string was found: nothing after it may be added
        self._decode_with_special = make_decode_fn(tokenizer) if tokenizer is not None else None
        # FINAL_ONLY without stop strings: no text is read before the end, so the tokens wait there and are decoded
        # in one call with the window, where that is what the window's steps add up to (decodes_bytes_at_once)
        self._bytes_at_once = decodes_bytes_at_once(tokenizer)
        deferring = not self.stop and params.output_kind == RequestOutputKind.FINAL_ONLY
        self._deferred: list[int] | None = [] if deferring and self._bytes_at_once else None
        if not params.detokenize:
            return
        self._decode = make_decode_fn(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        # A prompt that ends inside a character would glue its bytes to the output's: leave those tokens out.
        while context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context.pop()
        self._ids = context
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)

    @property
    def output_text(self) -> str:
        """All the text so far (stop string and stop token excluded as the params say)."""
        return self._text.getvalue()

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Appends the tokens just generated; returns the stop string that ended the sequence, if one did.

        With `stop_terminated` the last token is the eos/stop token that ended the sequence: its text is never
        added (as in vLLM), and the text still waiting for a complete character is flushed. When a stop string ends
        before the last of several new tokens, num_output_tokens counts the tokens up to the one that completed it.
        """
        if len(new_token_ids) > 1 and self.stop and not self._is_stopped:
            # several tokens at once (speculative decoding): one at a time, so that num_output_tokens stops at the
            # token that completed a stop string and the caller can drop the ones after it
            last = len(new_token_ids) - 1
            for i, token_id in enumerate(new_token_ids):
                stop = self.update([token_id], stop_terminated and i == last)
                if stop is not None:
                    return stop
            return None
        num_tokens_before = self.num_output_tokens
        self.num_output_tokens += len(new_token_ids)
        if not self.params.detokenize or self._is_stopped:
            return None
        if stop_terminated:
            new_token_ids = new_token_ids[:-1]
        if self._deferred is not None:
            self._deferred.extend(new_token_ids)
            return None
        # Stop strings must end in text produced after the first min_tokens tokens.
        check_from = self._num_chars
        for i, token_id in enumerate(new_token_ids):
            self._append(self._decode_next(token_id))
            if num_tokens_before + i + 1 <= self.params.min_tokens:
                check_from = self._num_chars
        if stop_terminated:
            self._append(self._take_pending_text())
        return self._check_stop_strings(check_from)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to emit now: all of it, or (delta) only what was not emitted before.

        While unfinished, the last `stop_buffer_length` chars are held back; when finished, the text still
        waiting for a complete character is flushed (an undecodable tail reads U+FFFD, as in a full decode).
        """
        if self._deferred:
            self._catch_up(finished)
        if finished and self.params.detokenize and not self._is_stopped:
            check_from = self._num_chars
            self._append(self._take_pending_text())
            self._check_stop_strings(check_from)
        end = self._num_chars if finished else max(self._num_chars - self.stop_buffer_length, 0)
        if not delta:
            return self._read(0, end)
        if end <= self._num_emitted_chars:
            return ""
        text = self._read(self._num_emitted_chars, end)
        self._num_emitted_chars = end
        return text

    def _catch_up(self, finished: bool) -> None:
        """Decodes the deferred tokens: finished, all in one call with the window; else one at a time."""
        ids, self._deferred = self._deferred, []
        if finished:
            self._ids.extend(ids)
            self._append(self._take_pending_text())
            return
        for token_id in ids:
            self._append(self._decode_next(token_id))

    def decode_token(self, token_id: int) -> str:
        """One token's text on its own, as `tokenizer.decode([token_id])` shows it (for Logprob.decoded_token)."""
        return self._decode_with_special([token_id])

    def _decode_next(self, token_id: int) -> str:
        """Adds one token to the window; returns the text that became complete (maybe "")."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) < len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            if len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS:
                return self._split_stalled_window(text)
            return ""
        return self._slide_window(len(self._ids), text)

    def _slide_window(self, read_offset: int, text: str) -> str:
        """Emits the window's text up to `read_offset` (`text`); the old pending tokens become the context."""
        new_text = text[len(self._prefix_text):]
        self._ids = self._ids[self._read_offset:]
        self._read_offset = read_offset - self._read_offset
        # a byte-level decoder's text of the emitted tokens is what they added, their last character complete
        self._prefix_text = new_text if self._bytes_at_once else self._decode(self._ids[:self._read_offset])
        return new_text

    def _split_stalled_window(self, text: str) -> str:
        """Emits the settled start of a stalled window: up to a token boundary that decoding does not cross."""
        ids = self._ids
        for k in range(len(ids) - 1, max(len(ids) - 1 - _NUM_SPLIT_CANDIDATES, self._read_offset), -1):
            left, right = self._decode(ids[:k]), self._decode(ids[k:])
            # right's first byte cannot continue left's last character, so no later token can change left
            if right and left + right == text and len(left) >= len(self._prefix_text):
                return self._slide_window(k, left)
        return ""

    def _take_pending_text(self) -> str:
        """The text of the pending tokens as it decodes now, U+FFFD included; the window then starts afresh."""
        text = self._decode(self._ids)
        new_text = text[len(self._prefix_text):]
        self._ids, self._read_offset, self._prefix_text = [], 0, ""
        return new_text

    def _check_stop_strings(self, check_from: int) -> str | None:
        """Finds the stop string that ends first in the text after `check_from`; cuts the text there.

        Ending first is what a char-by-char stream would see first, so the outcome does not depend on how the
        text was split into tokens; of two that end together the longer wins.
        """
        if not self.stop or self._num_chars <= check_from or self.num_output_tokens <= self.params.min_tokens:
            return None
        start = max(check_from - self._max_stop_len + 1, 0)
        tail = self._read(start, self._num_chars)
        best = None
        for stop in self.stop:
            i = tail.find(stop, max(check_from - len(stop) + 1 - start, 0))
            if i != -1 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        if best is None:
            return None
        stop_end, stop_start, stop = best
        self._truncate(start + (stop_end if self.params.include_stop_str_in_output else stop_start))
        self._is_stopped = True
        return stop

    def _append(self, text: str) -> None:
        if text:
            self._text.seek(self._num_chars)
            self._text.write(text)
            self._num_chars += len(text)

    def _read(self, start: int, end: int) -> str:
        self._text.seek(start)
        return self._text.read(end - start)

    def _truncate(self, num_chars: int) -> None:
        self._text.truncate(num_chars)
        self._num_chars = num_chars
