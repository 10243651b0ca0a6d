"""SuffixProposer on the CPU: exact drafts on small sequences, and a brute-force reference that counts each
continuation of each suffix directly (hypothesis)."""
import math
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from kvserve.errors import InvalidRequestError
from kvserve.spec_decode.suffix import SuffixProposer, SuffixTree


def count_nodes(node) -> int:
    return sum(1 + count_nodes(child) for child in node.children.values())


def propose_once(token_ids, k=8, max_tokens=100, **kw):
    return SuffixProposer(k, **kw).propose("r", token_ids, len(token_ids), max_tokens)


# --- brute-force reference: no tree, count continuations in the sequences themselves ---

def continuations(context, corpus, max_depth):
    """How often each token follows `context` in the sequences of `corpus`, for paths of at most max_depth tokens."""
    counts = Counter()
    if len(context) + 1 > max_depth:
        return counts
    m = len(context)
    for seq in corpus:
        for i in range(len(seq) - m):
            if seq[i:i + m] == context:
                counts[seq[i + m]] += 1
    return counts


def reference_draft(token_ids, corpus, limit, max_depth, min_token_prob, min_match_len, max_spec_factor=None):
    """(draft, score) from the longest suffix of token_ids that `corpus` continues; ([], 0.0) when none. With
    max_spec_factor f, a draft is at most f x its match's length, and the match leaves the depth room for the
    longest draft any match length allows."""
    cap = (lambda m: limit) if max_spec_factor is None else (lambda m: min(limit, math.floor(max_spec_factor * m
                                                                                              + 1e-9)))
    room = limit if max_spec_factor is None else max(min(cap(m), max_depth - m) for m in range(1, max_depth))
    hi = min(len(token_ids), max(max_depth - room, min_match_len))
    for m in range(hi, min_match_len - 1, -1):
        if continuations(token_ids[-m:], corpus, max_depth):
            context = token_ids[-m:]
            break
    else:
        return [], 0.0
    limit = cap(m)
    draft, score, prob = [], 0.0, 1.0
    while len(draft) < limit:
        counts = continuations(context, corpus, max_depth)
        if not counts:
            break
        token = min(counts, key=lambda t: (-counts[t], t))
        prob *= counts[token] / sum(counts.values())
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        context = context + [token]
    return draft, score


def reference_propose(token_ids, finished_outputs, k, max_tokens, max_depth, min_token_prob, min_match_len,
                      max_spec_factor=None):
    limit = min(k, max_tokens)
    if limit <= 0:
        return []
    args = (limit, max_depth, min_token_prob, min_match_len, max_spec_factor)
    local, local_score = reference_draft(token_ids, [token_ids], *args)
    cached, cached_score = reference_draft(token_ids, finished_outputs, *args)
    return cached if cached_score > local_score else local


# --- exact cases ---

def test_repeated_pattern_in_the_prompt_is_proposed():
    prompt = [1, 5, 6, 7, 8, 9, 2, 3, 5, 6, 7, 8, 9, 4, 5, 6]
    assert propose_once(prompt, k=3) == [7, 8, 9]
    # after 9 came 2 once and 4 once: the product halves to 0.5, still >= 0.1, and the tie goes to the smaller id
    assert propose_once(prompt, k=8) == [7, 8, 9, 2, 3, 5, 6, 7]


def test_ambiguous_continuation_stops_early_frequent_one_goes_longer():
    # after [1, 2] came 3 once and 4 once: p = 0.5 < 0.6, nothing is worth drafting
    ambiguous = [1, 2, 3, 1, 2, 4, 1, 2]
    assert propose_once(ambiguous, min_token_prob=0.6) == []
    assert propose_once(ambiguous, min_token_prob=0.5) == [3, 1, 2, 4, 1, 2]
    # three times [1, 2, 3, 7, 8], once [1, 2, 4]: 3 with p = 3/4, then 7, 8, 1 with certainty, then 3 with 2/3
    frequent = [1, 2, 3, 7, 8, 1, 2, 3, 7, 8, 1, 2, 3, 7, 8, 1, 2, 4, 9, 1, 2]
    assert propose_once(frequent, k=4, min_token_prob=0.6) == [3, 7, 8, 1]


def test_draft_stops_when_the_product_of_probabilities_drops():
    # 3 follows [9] in 2 of 3 cases, then 4 follows [9, 3] in 1 of 2: 2/3 then 1/3, below 0.5
    seq = [9, 3, 4, 9, 3, 5, 9, 6, 9]
    assert propose_once(seq, min_token_prob=0.5) == [3]
    assert propose_once(seq, k=2, min_token_prob=0.3) == [3, 4]


def test_no_match_proposes_nothing():
    assert propose_once([1, 2, 3, 4, 5]) == []
    assert propose_once([]) == []
    assert propose_once([7]) == []


def test_min_match_len():
    seq = [1, 2, 9, 3, 2]   # only the last token, 2, occurred before (followed by 9)
    assert propose_once(seq, min_match_len=1) == [9, 3, 2]
    assert propose_once(seq, min_match_len=2) == []


def test_max_tokens_and_num_speculative_tokens_cap_the_draft():
    seq = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2]
    assert propose_once(seq, k=8, max_tokens=3) == [3, 4, 5]
    assert propose_once(seq, k=2, max_tokens=100) == [3, 4]
    assert propose_once(seq, k=8, max_tokens=0) == []


def test_max_spec_factor_sizes_the_draft_by_the_match():
    # the last 2 tokens [5, 6] occurred before, the 3 tokens [9, 5, 6] did not: a 2-token match
    seq = [1, 5, 6, 7, 8, 9, 10, 11, 2, 5, 6]
    assert propose_once(seq, k=8) == [7, 8, 9, 10, 11, 2, 5, 6]
    assert propose_once(seq, k=8, max_spec_factor=1.0) == [7, 8]
    assert propose_once(seq, k=8, max_spec_factor=2.5) == [7, 8, 9, 10, 11]
    assert propose_once(seq, k=8, max_spec_factor=0.4) == []
    # a copy under way matches long: the factor no longer binds, k does
    block = list(range(100, 140))
    assert propose_once(block + block[:12], k=8, max_spec_factor=1.0) == block[12:20]


def test_max_spec_factor_splits_the_tree_depth_between_match_and_draft():
    block = list(range(100, 140))
    seq = block + block[:30]
    # depth 24 at factor 1: a match of at most 12 and a draft of at most 12, not 24 - 16 = 8 and 8
    assert propose_once(seq, k=16, max_tree_depth=24, max_spec_factor=1.0) == (block * 2)[30:42]
    assert propose_once(seq, k=16, max_tree_depth=24) == (block * 2)[30:46]
    # factor 1.5: a match of 10 allows 15 and leaves 14; 9 allows 13
    assert propose_once(seq, k=16, max_tree_depth=24, max_spec_factor=1.5) == (block * 2)[30:44]


def test_a_repeat_longer_than_the_tree_depth_still_drafts_in_full():
    block = list(range(100, 140))
    seq = block + block[:30]
    # the match leaves room for the draft: max_tree_depth 24 holds 24 - 5 matched tokens and 5 draft tokens
    assert propose_once(seq, k=5, max_tree_depth=24) == block[30:35]


def test_incremental_growth_matches_a_fresh_tree():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    proposer = SuffixProposer(4, max_tree_depth=6)
    n = 3
    for step in [1, 2, 5, 1, 3, 4, 1, 2, 5, 1, 1, 3]:
        n = min(n + step, len(seq))
        got = proposer.propose("r", seq[:n], 3, 100)
        assert got == SuffixProposer(4, max_tree_depth=6).propose("fresh", seq[:n], 3, 100)


def test_a_restarted_request_is_rebuilt():
    proposer = SuffixProposer(4)
    first = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2]
    assert proposer.propose("r", first, 3, 100) == [3, 4, 9, 1]
    # longer, but not an extension (extending the old tree would give [4, 9, 1, 2])
    second = [1, 2, 3, 5, 1, 2, 3, 6, 6, 6, 1, 2, 3]
    assert proposer.propose("r", second, 3, 100) == propose_once(second, k=4) == [5, 1, 2, 3]
    # same length, another last token
    assert proposer.propose("r", second[:-1] + [7], 3, 100) == []
    # restarted from its prompt: shorter than what was seen, the old outputs must not linger
    assert proposer.propose("r", second[:3], 3, 100) == []
    assert proposer.propose("r", second[:6], 3, 100) == [3, 5, 1, 2]


def test_finished_output_feeds_other_requests():
    proposer = SuffixProposer(4)
    prompt = [50, 51]
    proposer.propose("a", prompt + [10, 11, 12], 2, 100)
    proposer.finish("a", prompt + [10, 11, 12, 13, 14, 15], 2)
    assert proposer.num_cached_requests == 1
    # a different prompt; the request's own tree has nothing, the finished output continues [11, 12]
    assert proposer.propose("b", [60, 61, 62, 11, 12], 3, 100) == [13, 14, 15]
    # the prompt of "a" is not in the global tree
    assert proposer.propose("c", [70, 50], 2, 100) == []


def test_per_request_tree_wins_ties_and_better_score_wins():
    proposer = SuffixProposer(4)
    proposer.finish("a", [1, 2, 8, 8, 8], 0)
    # both trees continue [1, 2] with certainty: score 3 each
    assert proposer.propose("b", [1, 2, 7, 5, 1, 2], 0, 3) == [7, 5, 1]
    # the request's own continuation is a coin toss (score 0.5 + 0.5 + 0.5) against 3 for the global tree's
    assert proposer.propose("c", [1, 2, 7, 1, 2, 6, 1, 2], 0, 3) == [8, 8, 8]


def test_fifo_eviction_removes_outputs_and_their_nodes():
    proposer = SuffixProposer(4, max_tree_depth=5, max_cached_requests=2)
    tree = proposer.global_tree
    proposer.finish("a", [0, 1, 2, 3, 4, 1, 2, 3], 1)
    proposer.finish("b", [0, 20, 21, 22, 1, 2], 1)
    assert proposer.propose("x", [9, 20, 21], 0, 100) == [22, 1, 2]
    assert proposer.propose("y", [9, 2], 0, 100) == [3, 4, 1, 2]
    proposer.finish("c", [0, 30, 31, 32], 1)   # evicts "a"
    assert proposer.num_cached_requests == 2
    assert proposer.propose("y2", [9, 3], 0, 100) == []
    assert proposer.propose("x2", [9, 20, 21], 0, 100) == [22, 1, 2]
    assert tree.num_nodes == count_nodes(tree.root)
    proposer.finish("d", [0, 40], 1)
    proposer.finish("e", [0, 41], 1)   # "b" and "c" are gone
    assert proposer.propose("x3", [9, 20, 21], 0, 100) == []
    proposer.finish("f", [0], 1)       # an empty output is not cached and evicts nothing
    assert proposer.num_cached_requests == 2
    assert tree.num_nodes == count_nodes(tree.root) == 2
    for output in proposer._cached_outputs:
        tree.remove(output)
    assert tree.num_nodes == count_nodes(tree.root) == 0
    assert tree.root.children == {}


def test_finish_drops_the_request_tree():
    proposer = SuffixProposer(4, max_cached_requests=0)
    proposer.propose("r", [1, 2, 1], 1, 100)
    proposer.finish("r", [1, 2, 1, 2], 1)
    proposer.finish("never-proposed", None, 0)
    assert proposer._requests == {}
    assert proposer.num_cached_requests == 0 and proposer.global_tree.num_nodes == 0


def test_tree_counts_are_occurrences():
    tree = SuffixTree(3)
    tree.add([1, 2, 1, 2, 1])
    assert tree.find([1]).count == 3
    assert tree.find([1, 2]).count == 2
    assert tree.find([2, 1]).count == 2
    assert tree.find([1, 2, 1]).count == 2
    assert tree.find([1, 2, 1, 2]) is None   # deeper than max_depth
    assert tree.num_nodes == count_nodes(tree.root) == 6


@pytest.mark.parametrize("kw, param", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(max_tree_depth=1), "max_tree_depth"),
    (dict(max_cached_requests=-1), "max_cached_requests"),
    (dict(min_token_prob=1.5), "min_token_prob"),
    (dict(min_match_len=0), "min_match_len"),
    (dict(min_match_len=24), "min_match_len"),
    (dict(max_spec_factor=0), "max_spec_factor"),
    (dict(max_spec_factor=1e308), "max_spec_factor"),
    (dict(max_spec_factor=True), "max_spec_factor"),
    (dict(max_spec_factor="2"), "max_spec_factor"),
])
def test_bad_arguments_raise(kw, param):
    with pytest.raises(InvalidRequestError) as err:
        SuffixProposer(**{"num_speculative_tokens": 4, **kw})
    assert err.value.param == param


# --- property tests against the brute-force reference ---

settings_ = settings(max_examples=200, deadline=None, derandomize=True)
params = dict(k=st.integers(1, 6), max_depth=st.integers(2, 8), min_token_prob=st.sampled_from([0.0, 0.1, 0.3, 0.6]),
              min_match_len=st.integers(1, 3), max_spec_factor=st.sampled_from([None, 0.5, 1.0, 1.5, 3.0]))


@settings_
@given(seq=st.lists(st.integers(0, 3), max_size=60), steps=st.lists(st.integers(1, 7), min_size=1, max_size=30),
       max_tokens=st.integers(0, 8), **params)
def test_incremental_request_tree_matches_brute_force(seq, steps, max_tokens, k, max_depth, min_token_prob,
                                                      min_match_len, max_spec_factor):
    min_match_len = min(min_match_len, max_depth - 1)
    proposer = SuffixProposer(k, max_depth, min_token_prob=min_token_prob, min_match_len=min_match_len,
                              max_spec_factor=max_spec_factor)
    n = 0
    for step in steps:
        n = min(n + step, len(seq))
        got = proposer.propose("r", seq[:n], 0, max_tokens)
        assert got == reference_propose(seq[:n], [], k, max_tokens, max_depth, min_token_prob, min_match_len,
                                        max_spec_factor)
    tree = proposer._requests["r"].tree
    assert tree.num_nodes == count_nodes(tree.root)


@settings_
@given(outputs=st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=8), query=st.lists(st.integers(0, 3),
       max_size=12), max_cached=st.integers(0, 3), **params)
def test_global_tree_with_eviction_matches_brute_force(outputs, query, max_cached, k, max_depth, min_token_prob,
                                                       min_match_len, max_spec_factor):
    min_match_len = min(min_match_len, max_depth - 1)
    proposer = SuffixProposer(k, max_depth, max_cached, min_token_prob, min_match_len, max_spec_factor)
    for i, output in enumerate(outputs):
        proposer.finish(f"done-{i}", [99] + output, 1)
    cached = [o for o in outputs if o][-max_cached:] if max_cached else []
    got = proposer.propose("q", query, 0, 100)
    assert got == reference_propose(query, cached, k, 100, max_depth, min_token_prob, min_match_len, max_spec_factor)
    tree = proposer.global_tree
    assert tree.num_nodes == count_nodes(tree.root)
    for output in cached:   # removing what is left empties the tree: no zero-count nodes linger
        tree.remove(output)
    assert tree.num_nodes == count_nodes(tree.root) == 0
