"""allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's names): each against what it must equal, in a
batch beside requests without it, through async scheduling, and their bad values refused with a typed error."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.sample.constraints import bad_words_token_ids, banned_by_bad_words, truncate_prompt

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, seed=0)


def greedy(llm, prompts, **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 20, **kw})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_allowed_token_ids_sample_only_among_them(llm):
    """Greedy over the allowed tokens is the greedy of a logit bias that lifts them above every other token; a
    seeded random row draws only allowed tokens; a row beside them without the setting is untouched."""
    base = greedy(llm, [PROMPT])[0]
    allowed = sorted(set(base[:4]) | {2, 1000, 1001})
    prompts = [PROMPT, "Name a color.", PROMPT]
    params = [SamplingParams(temperature=0, max_tokens=20, allowed_token_ids=allowed),
              SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=1.0, seed=7, max_tokens=20, allowed_token_ids=allowed)]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[0] == greedy(llm, [PROMPT], logit_bias={t: 100 for t in allowed})[0]
    assert outs[1] == greedy(llm, ["Name a color."])[0]
    assert set(outs[0]) <= set(allowed) and set(outs[2]) <= set(allowed) and outs[0] != base


def test_bad_words_ban_a_words_last_token_once_its_others_came(llm):
    """A word of several tokens is cut at its last token: the output equals the free one up to
    there, then takes another token; a word of one token never appears; with async scheduling (each step launched
    before the last one's token is back: such a request waits for it) the same tokens."""
    tok = llm.get_tokenizer()
    base = greedy(llm, [PROMPT])[0]

    def found(seq):   # where the free output writes seq, or None
        return next((i for i in range(len(base)) if base[i:i + len(seq)] == seq), None)
    # a word of the free output that its encodings write with several tokens (which word depends on the CPU's
    # kernels: their logits differ in rounding)
    word, multi = next((w, s) for n in (3, 2, 4) for i in range(1, len(base) - n)
                       for w in [tok.decode(base[i:i + n]).strip()] if w
                       for s in bad_words_token_ids([w], tok) if len(s) > 1 and found(s) is not None)
    seqs = bad_words_token_ids([word, "Paris"], tok)
    at = min(found(s) + len(s) - 1 for s in bad_words_token_ids([word], tok) if found(s) is not None)   # either way
    cut = greedy(llm, [PROMPT, PROMPT], bad_words=[word])
    assert cut[0] == cut[1] and cut[0][:at] == base[:at] and cut[0][at] != base[at]
    no_paris = greedy(llm, [PROMPT], bad_words=["Paris"])[0]
    assert base[0] in {s[0] for s in seqs if len(s) == 1} and base[0] not in no_paris
    overlapped = LLM(max_model_len=256, seed=0, async_scheduling=True)
    assert greedy(overlapped, [PROMPT, PROMPT], bad_words=[word]) == cut


def test_banned_by_bad_words_matches_the_outputs_end():
    seqs = [[5], [1, 2, 3], [2, 9]]
    assert banned_by_bad_words(seqs, []) == {5}
    assert banned_by_bad_words(seqs, [1, 2]) == {5, 3, 9}
    assert banned_by_bad_words(seqs, [2, 1]) == {5}
    assert banned_by_bad_words(seqs, [7, 1, 2]) == {5, 3, 9}


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    tok = llm.get_tokenizer()
    text = "one two three four five six seven eight nine ten " * 3
    ids = tok.encode(text)
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=6),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-6:]
    assert out.outputs[0].token_ids == greedy(llm, [{"prompt_token_ids": ids[-6:]}], max_tokens=8)[0]
    whole = llm.generate([text], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids
    # -1 on a prompt longer than the context: as much of its end as leaves max_tokens of room
    long = llm.generate([{"prompt_token_ids": ids * 20}],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0]
    assert long.prompt_token_ids == (ids * 20)[-251:] and len(long.outputs[0].token_ids) == 5
    with pytest.raises(InvalidRequestError, match="max_model_len") as e:
        llm.generate([text], SamplingParams(max_tokens=1, truncate_prompt_tokens=257), use_tqdm=False)
    assert e.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize("kwargs,param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"), ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
    ({"allowed_token_ids": [3], "structured_outputs": {"regex": "a+"}}, "allowed_token_ids"),
    ({"bad_words": ["a"], "structured_outputs": {"regex": "a+"}}, "bad_words"),
    ({"bad_words": "Paris"}, "bad_words"), ({"bad_words": [""]}, "bad_words"), ({"bad_words": [3]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens")])
def test_bad_values_are_refused(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_requests_that_leave_nothing_to_sample_are_refused_and_the_engine_goes_on(llm):
    eos = sorted(llm.llm_engine.eos_token_ids)
    for params in (SamplingParams(allowed_token_ids=[llm.llm_engine.vocab_size]),
                   SamplingParams(allowed_token_ids=eos, min_tokens=2),
                   SamplingParams(allowed_token_ids=bad_words_token_ids(["Paris"], llm.get_tokenizer())[0][:1],
                                  bad_words=["Paris"])):
        with pytest.raises(InvalidRequestError) as e:
            llm.generate([PROMPT], params, use_tqdm=False)
        assert e.value.param == "allowed_token_ids"
    assert greedy(llm, [PROMPT])[0] == greedy(llm, [PROMPT])[0]


class _BosTokenizer:
    """A tokenizer that puts BOS (1) first: one token per character, 'a' -> 97."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_truncation_keeps_a_leading_bos():
    tok, ids = _BosTokenizer(), [1, 10, 11, 12, 13, 14]
    assert truncate_prompt(ids, 3, 100, 1, tok) == [1, 13, 14]
    assert truncate_prompt(ids[1:], 3, 100, 1, tok) == [12, 13, 14]   # token ids without BOS: a plain cut
    assert truncate_prompt(ids, 1, 100, 1, tok) == [14]               # no room beside BOS: a plain cut
    assert truncate_prompt(ids, 6, 100, 1, tok) == ids and truncate_prompt(ids, None, 100, 1, tok) == ids
    assert truncate_prompt(ids * 10, -1, 20, 4, tok) == [1] + (ids * 10)[-15:]   # max_model_len - room


def test_a_multi_token_bad_word_yields_where_it_would_leave_nothing_allowed():
    """Allowed {5, 6}, a one-token bad word 6: after [3], the two-token word [3, 5] would ban the last allowed
    token, so it yields for that step; the one-token word stays banned."""
    from kvserve.sample.metadata import SamplingMetadata, SamplingRow
    params = SamplingParams(temperature=0, allowed_token_ids=[5, 6])
    params.bad_words_token_ids = [[6], [3, 5], [4, 7]]
    rows = [SamplingRow(params, [9], [3]), SamplingRow(params, [9], [4])]
    meta = SamplingMetadata.build(rows, 10, "cpu")
    assert sorted(meta.banned.flat_ids.tolist()) == [6, 10 + 6, 10 + 7]
