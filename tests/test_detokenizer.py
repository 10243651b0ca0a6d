"""IncrementalDetokenizer against full decodes of the bundled byte-level tokenizer: multi-byte characters split
across tokens, special tokens, stop strings across tokens, streaming without retractions, bounded per-token cost."""
import pytest
from hypothesis import given, settings, strategies as st

from kvserve.engine.detokenizer import IncrementalDetokenizer, detokenize_logprobs
from kvserve.outputs import Logprob
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from tokenizer_utils import byte_token_ids, load_smollm2_tokenizer, sentencepiece_style_tokenizer

FFFD = "\ufffd"
TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It wasn't me, said the fox!",
    "code": 'def f(x):\n    return {"a": x ** 2}  # square\n\n\tprint(f(3))\r\n',
    "emoji": "🙂👍🏽 ok 🇫🇷👨‍👩‍👧",
    "cjk": "你好，世界。日本語のテキスト。안녕하세요",
    "mixed": "naïve café — 你好 🙂 x² ∑ <tag> ok",
}
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tok():
    return load_smollm2_tokenizer()


def detok(tok, prompt=(), **params):
    return IncrementalDetokenizer(tok, list(prompt), SamplingParams(**params))


def feed(d, ids, chunk=1, stop_terminated=False):
    """update() `chunk` tokens at a time; returns the stop string, if any."""
    stop = None
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        stop = d.update(ids[i:i + chunk], stop_terminated and last)
        if stop is not None:
            return stop
    return stop


def check_incremental(tok, ids, chunk=1, skip=True):
    """After every update the text is the full decode, minus a trailing incomplete character; at the end, all of it."""
    d = detok(tok, skip_special_tokens=skip)
    for i in range(0, len(ids), chunk):
        d.update(ids[i:i + chunk], False)
        full = tok.decode(ids[:i + chunk], skip_special_tokens=skip)
        assert full.startswith(d.output_text)
        if not full.endswith(FFFD):
            assert d.output_text == full
    assert d.get_next_output_text(finished=True, delta=False) == tok.decode(ids, skip_special_tokens=skip)
    assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
    return d


def stream(d, ids, chunk=1, stop_terminated=False):
    """Streams deltas as the engine does; checks that nothing emitted is ever retracted. Returns (text, stop)."""
    deltas, cumulative, stop = [], [], None
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        stop = d.update(ids[i:i + chunk], stop_terminated and last)
        finished = stop is not None or last
        cumulative.append(d.get_next_output_text(finished, delta=False))
        deltas.append(d.get_next_output_text(finished, delta=True))
        if finished:
            break
    final = d.output_text
    assert "".join(deltas) == final
    assert all(final.startswith(c) for c in cumulative) and cumulative[-1] == final
    return final, stop


def expected_stop(text, stops, include):
    """The stop string that ends first (the longer on a tie) and the text cut at it."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, s = min(found)
    return text[:end if include else start], s


# ---------------------------------------------------------------- incremental == full decode

@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_matches_full_decode(tok, name, chunk):
    ids = tok.encode(TEXTS[name])
    d = check_incremental(tok, ids, chunk)
    assert d.output_text == TEXTS[name]


@pytest.mark.parametrize("name", ["emoji", "cjk", "mixed"])
def test_partial_characters_are_never_emitted(tok, name):
    ids = tok.encode(TEXTS[name])
    assert any(FFFD in tok.decode([t]) for t in ids), "the text should split characters across tokens"
    d = detok(tok)
    seen = []
    for t in ids:
        d.update([t], False)
        seen.append(d.get_next_output_text(finished=False, delta=True))
        assert FFFD not in d.output_text
    assert "".join(seen) == TEXTS[name]


@st.composite
def random_ids(draw):
    """Token ids anywhere in the vocabulary, with many lone bytes and special tokens among them."""
    tok = load_smollm2_tokenizer()
    lone_bytes = sorted(byte_token_ids(tok).values())
    token_id = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(lone_bytes), st.integers(0, 16))
    return draw(st.lists(token_id, max_size=40))


@settings(max_examples=150, deadline=None)
@given(ids=random_ids(), chunk=st.integers(1, 4), skip=st.booleans())
def test_random_token_ids_match_full_decode(ids, chunk, skip):
    check_incremental(load_smollm2_tokenizer(), ids, chunk, skip)


@pytest.mark.parametrize("byte_values", [
    [0xE4] * 60, [0x80] * 60, [0xE4, 0xBD] * 30, [0xF0, 0x9F, 0x99] * 20,
    [0xE4] * 6 + [0xBD, 0xA0],    # the stall is long when 你 is half done: its bytes must not be split
    [0x80] * 5 + [0xF0, 0x9F, 0x99, 0x82] * 3,
])
def test_long_undecodable_run_keeps_window_small(tok, byte_values):
    byte_ids = byte_token_ids(tok)
    ids = tok.encode("ok ") + [byte_ids[b] for b in byte_values] + tok.encode(" done")
    d = detok(tok)
    for i, t in enumerate(ids):
        d.update([t], False)
        assert len(d._ids) <= 16
        assert tok.decode(ids[:i + 1]).startswith(d.output_text)
    assert d.output_text == tok.decode(ids)


def test_decode_cost_per_token_does_not_grow(tok):
    ids = tok.encode(" ".join(TEXTS.values()) * 20)
    d = detok(tok)
    decode, num_decoded = d._decode, [0]

    def counting_decode(window):
        num_decoded[0] += len(window)
        return decode(window)

    d._decode = counting_decode
    feed(d, ids)
    assert len(ids) > 1000
    assert num_decoded[0] < 12 * len(ids)
    assert d.output_text == tok.decode(ids)


def test_unfinished_character_is_flushed_when_finished(tok):
    ids = tok.encode("ab") + [byte_token_ids(tok)[0xE4]]
    d = detok(tok)
    feed(d, ids)
    assert d.output_text == "ab"
    assert d.get_next_output_text(finished=False, delta=True) == "ab"
    assert d.get_next_output_text(finished=True, delta=True) == FFFD
    assert d.output_text == tok.decode(ids) == "ab" + FFFD
    assert d.get_next_output_text(finished=True, delta=True) == ""


def test_prompt_context(tok):
    # byte-level text does not depend on the prompt...
    ids = tok.encode(TEXTS["mixed"])
    d = detok(tok, prompt=tok.encode("<|im_start|>user\nhi 🙂<|im_end|>\n<|im_start|>assistant\n"))
    assert len(d._ids) <= 5, "only the end of the prompt is decoded with the output"
    feed(d, ids)
    assert d.output_text == TEXTS["mixed"]
    # ...even when the prompt ends inside a character: its bytes are not glued to the output's
    cjk = tok.encode("你")
    assert len(cjk) > 1
    d = detok(tok, prompt=tok.encode("x") + cjk[:1])
    feed(d, cjk[1:])
    assert d.get_next_output_text(finished=True, delta=False) == tok.decode(cjk[1:])


class SlowTokenizer:
    """Only `decode`, as a slow (Python) tokenizer offers it."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True,
               clean_up_tokenization_spaces=None):
        self.calls.append(spaces_between_special_tokens)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["backend", "slow"])
def test_other_tokenizer_kinds(tok, kind):
    other = tok.backend_tokenizer if kind == "backend" else SlowTokenizer(tok)
    ids = tok.encode(TEXTS["mixed"] + "<|im_end|>")
    d = IncrementalDetokenizer(other, [], SamplingParams(spaces_between_special_tokens=False))
    feed(d, ids)
    assert d.output_text == TEXTS["mixed"]
    assert d.decode_token(EOS) == "<|im_end|>"
    if kind == "slow":
        assert False in other.calls


# ---------------------------------------------------------------- special tokens

@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens(tok, skip, spaces):
    ids = tok.encode("<|im_start|>Hi<|im_end|><|im_end|>there 🙂<|endoftext|>")
    assert EOS in ids
    d = detok(tok, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    feed(d, ids)
    assert d.output_text == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert d.output_text == ("Hithere 🙂" if skip else "<|im_start|>Hi<|im_end|><|im_end|>there 🙂<|endoftext|>")


@pytest.mark.parametrize("include", [True, False])
def test_stop_token_text_is_never_included(tok, include):
    ids = tok.encode("Hello there")
    d = detok(tok, skip_special_tokens=False, include_stop_str_in_output=include)
    assert d.update(ids, False) is None
    assert d.update([EOS], True) is None
    assert d.output_text == "Hello there"
    # a stop token id that is an ordinary token: its text is dropped too (vLLM)
    dot = tok.encode(".")
    d = detok(tok, stop_token_ids=dot, include_stop_str_in_output=include)
    feed(d, ids + dot, chunk=len(ids) + 1, stop_terminated=True)
    assert d.output_text == "Hello there"


def test_special_token_splitting_a_character(tok):
    emoji = tok.encode("🙂")
    ids = emoji[:1] + [EOS] + emoji[1:]
    for skip in (True, False):
        check_incremental(tok, ids, skip=skip)


def test_stop_token_flushes_unfinished_character(tok):
    ids = tok.encode("ab") + [byte_token_ids(tok)[0xE4], EOS]
    d = detok(tok)
    feed(d, ids, chunk=2, stop_terminated=True)
    assert d.output_text == "ab" + FFFD


# ---------------------------------------------------------------- decoded tokens

def test_decode_token(tok):
    d = detok(tok, skip_special_tokens=True)
    for text in ("Hello", " world", "🙂", "<|im_end|>"):
        for t in tok.encode(text):
            assert d.decode_token(t) == tok.decode([t])
    assert d.decode_token(tok.encode(" world")[0]) == " world"
    assert d.decode_token(EOS) == "<|im_end|>"
    assert d.decode_token(tok.encode("🙂")[0]) == FFFD


def test_detokenize_logprobs(tok):
    hello = tok.encode("Hello")[0]
    logprobs = [None, {hello: Logprob(-0.1, 1), EOS: Logprob(-3.0, 2)}]
    detokenize_logprobs(tok, logprobs)
    assert logprobs[1][hello].decoded_token == "Hello"
    assert logprobs[1][EOS].decoded_token == "<|im_end|>"


def test_detokenize_false(tok):
    d = detok(tok, detokenize=False, stop=["fox"])
    ids = tok.encode(TEXTS["english"])
    assert d.update(ids, False) is None
    assert d.output_text == ""
    assert d.get_next_output_text(finished=True, delta=False) == ""
    assert d.decode_token(ids[0]) == tok.decode(ids[:1])


# ---------------------------------------------------------------- stop strings

ENGLISH = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("stops, include, text, stop", [
    ([" fox"], False, "The quick brown", " fox"),                    # a whole token
    ([" fox"], True, "The quick brown fox", " fox"),
    (["own fox ju"], False, "The quick br", "own fox ju"),          # starts and ends inside tokens, spans 3
    (["own fox ju"], True, "The quick brown fox ju", "own fox ju"),
    (["lazy", " fox"], False, "The quick brown", " fox"),           # the earliest wins, whatever the list order
    ([" fox", "lazy"], False, "The quick brown", " fox"),
    (["brown fox", "own"], False, "The quick br", "own"),           # ends first: what a char stream sees first
    (["brown fox", "own"], True, "The quick brown", "own"),
    (["own fox", "fox"], False, "The quick br", "own fox"),         # ending together: the longer
    (["The"], False, "", "The"),                                      # at the very start
    (["The"], True, "The", "The"),
    (["T"], False, "", "T"),
    (["dog."], False, "The quick brown fox jumps over the lazy ", "dog."),  # at the very end
    (["cat", "xyz"], False, ENGLISH, None),
])
@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_stop_strings(tok, stops, include, text, stop, chunk):
    ids = tok.encode(ENGLISH)
    assert tok.encode(" fox") == [ids[3]], "' fox' should be one token"
    d = detok(tok, stop=stops, include_stop_str_in_output=include)
    assert stream(d, ids, chunk) == (text, stop)
    if stop is not None:   # nothing is added after a stop string
        assert d.update(tok.encode(" more"), False) is None and d.output_text == text


@pytest.mark.parametrize("name, stop_str, include, text", [
    ("emoji", "👍", False, "🙂"),
    ("emoji", "👍", True, "🙂👍"),
    ("cjk", "好，世", False, "你"),
    ("cjk", "界。", True, "你好，世界。"),
])
def test_stop_strings_in_multibyte_characters(tok, name, stop_str, include, text):
    d = detok(tok, stop=[stop_str], include_stop_str_in_output=include)
    assert stream(d, tok.encode(TEXTS[name])) == (text, stop_str)


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_stop_strings_wait_for_min_tokens(tok, chunk):
    ids = tok.encode("The cat. The dog.")
    assert tok.decode(ids[:3]) == "The cat."
    d = detok(tok, stop=["The"], min_tokens=3)
    assert stream(d, ids, chunk) == ("The cat. ", "The")


def test_partial_stop_string_is_held_back(tok):
    d = detok(tok, stop=["STOP!"])
    d.update(tok.encode("Hello STO"), False)
    assert d.get_next_output_text(finished=False, delta=False) == "Hello"
    assert d.get_next_output_text(finished=False, delta=True) == "Hello"
    d.update(tok.encode("P"), False)
    assert d.get_next_output_text(finished=False, delta=True) == " "
    assert d.get_next_output_text(finished=True, delta=True) == "STOP"
    assert d.output_text == "Hello STOP"


@settings(max_examples=120, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(TEXTS)), include=st.booleans(), chunk=st.integers(1, 3))
def test_stop_strings_stream_like_full_text(data, name, include, chunk):
    tok = load_smollm2_tokenizer()
    text = TEXTS[name]
    spans = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 8))
    stops = [text[i:i + n] for i, n in data.draw(st.lists(spans, min_size=1, max_size=3))]
    stops += data.draw(st.lists(st.sampled_from(["zz", "🙃", "\n\n\n"]), max_size=1))
    d = detok(tok, stop=stops, include_stop_str_in_output=include)
    assert stream(d, tok.encode(text), chunk) == expected_stop(text, stops, include)


# ---------------------------------------------------------------- FINAL_ONLY: decoded once, at the end

@settings(max_examples=150, deadline=None)
@given(ids=random_ids(), prompt=random_ids(), chunk=st.integers(1, 4), skip=st.booleans(),
       stop_terminated=st.booleans())
def test_final_only_decodes_once_what_the_window_steps_add_up_to(ids, prompt, chunk, skip, stop_terminated):
    """A FINAL_ONLY request without stop strings keeps its tokens and decodes them in one call when it finishes:
    the same text as decoding them a token at a time (after the prompt's context, with the stop token's text left
    out), and nothing decoded before."""
    tok = load_smollm2_tokenizer()
    final = detok(tok, prompt, skip_special_tokens=skip, output_kind=RequestOutputKind.FINAL_ONLY)
    stepwise = detok(tok, prompt, skip_special_tokens=skip)
    feed(final, ids, chunk, stop_terminated)
    feed(stepwise, ids, chunk, stop_terminated)
    assert final.output_text == "" and final.num_output_tokens == len(ids)
    want = stepwise.get_next_output_text(finished=True, delta=False)
    assert final.get_next_output_text(finished=True, delta=False) == want


@st.composite
def sentencepiece_case(draw):
    """Prompt and output ids for sentencepiece_style_tokenizer(): words, byte-fallback tokens, special tokens."""
    tok = sentencepiece_style_tokenizer()
    byte_ids = tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    token_id = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(byte_ids), st.integers(0, 2))
    return draw(st.lists(token_id, max_size=8)), draw(st.lists(token_id, max_size=40))


@settings(max_examples=150, deadline=None)
@given(case=sentencepiece_case(), chunk=st.integers(1, 4), skip=st.booleans(), stop_terminated=st.booleans())
def test_final_only_with_a_sentencepiece_style_tokenizer(case, chunk, skip, stop_terminated):
    """With "▁" spaces, byte fallback and a decoder that strips the text's leading space (Llama 2, Gemma), a run of
    byte tokens that is not UTF-8 decodes otherwise at once than a token at a time ([<0x00>, <0x80>]: two U+FFFD at
    once, NUL then U+FFFD stepwise): such a tokenizer's FINAL_ONLY text is decoded stepwise, as a stream's is."""
    tok = sentencepiece_style_tokenizer()
    prompt, ids = case
    final = detok(tok, prompt, skip_special_tokens=skip, output_kind=RequestOutputKind.FINAL_ONLY)
    stepwise = detok(tok, prompt, skip_special_tokens=skip)
    feed(final, ids, chunk, stop_terminated)
    feed(stepwise, ids, chunk, stop_terminated)
    assert final.get_next_output_text(finished=True, delta=False) == \
        stepwise.get_next_output_text(finished=True, delta=False)


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("prompt", ["", "Hi there"])
def test_incremental_with_a_sentencepiece_style_tokenizer(name, prompt):
    """A decoder that strips the text's leading space decodes a token otherwise at the start of a window than after
    its context: each window's context is decoded again, never taken from the text it emitted."""
    tok = sentencepiece_style_tokenizer()
    context = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(TEXTS[name], add_special_tokens=False)
    text, _ = stream(detok(tok, context), ids)
    assert text == tok.decode(context + ids)[len(tok.decode(context)):]


def test_final_only_text_asked_early_is_the_stepwise_text(tok):
    """Read before the end (an output forced out), the deferred tokens are decoded a token at a time: no partial
    character, and the rest follows at the end."""
    ids = tok.encode(TEXTS["emoji"])
    final = detok(tok, output_kind=RequestOutputKind.FINAL_ONLY)
    stepwise = detok(tok)
    half = len(ids) // 2 + 1
    feed(final, ids[:half])
    feed(stepwise, ids[:half])
    assert final.get_next_output_text(finished=False, delta=False) == stepwise.output_text
    feed(final, ids[half:])
    assert final.get_next_output_text(finished=True, delta=False) == TEXTS["emoji"]


def test_final_only_with_stop_strings_decodes_as_it_goes(tok):
    d = detok(tok, output_kind=RequestOutputKind.FINAL_ONLY, stop=["fox"])
    assert feed(d, tok.encode(TEXTS["english"])) == "fox"
    assert d.output_text == "The quick brown "
