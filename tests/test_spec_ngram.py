"""NgramProposer on the CPU: exact drafts, and against a brute-force reference (hypothesis), with and without
max_spec_factor, which sizes a draft by how far its match reaches back."""
import math

from hypothesis import given, settings, strategies as st

from kvserve.spec_decode.ngram import NgramProposer


def propose(seq, k=8, lo=2, hi=5, factor=None, max_tokens=100):
    return NgramProposer(k, lo, hi, factor).propose("r", seq, len(seq), max_tokens)


def reference(seq, k, lo, hi, factor, max_tokens):
    """The most recent earlier occurrence of the longest suffix n-gram (n from hi down to lo) that something follows;
    with a factor, the draft is at most factor x the length over which that occurrence and the end agree."""
    k = min(k, max_tokens)
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        starts = [i for i in range(len(seq) - n) if seq[i:i + n] == seq[len(seq) - n:]]
        if starts and k > 0:
            i = starts[-1]
            if factor is not None:   # the longest j for which the j tokens up to i + n equal the last j
                m = max(j for j in range(n, i + n + 1) if seq[i + n - j:i + n] == seq[len(seq) - j:])
                k = min(k, math.floor(factor * m + 1e-9))
            return seq[i + n:i + n + k]
    return []


def test_the_longest_recent_ngram_is_continued():
    seq = [1, 2, 3, 9, 2, 3, 4, 5, 6, 7, 2, 3]
    # [2, 3] last occurred at 4 (followed by 4), earlier at 1 (followed by 9): the most recent one
    assert propose(seq, k=3) == [4, 5, 6]
    assert propose([1, 2, 3, 4]) == []


def test_max_spec_factor_sizes_the_draft_by_how_far_the_match_reaches_back():
    # [7, 2, 3] ends the sequence; its last occurrence agrees over 3 tokens ([8] vs [6] before it differs)
    seq = [8, 7, 2, 3, 4, 5, 6, 10, 11, 12, 13, 6, 7, 2, 3]
    assert propose(seq, k=8, hi=3) == [4, 5, 6, 10, 11, 12, 13, 6]
    assert propose(seq, k=8, hi=3, factor=1.0) == [4, 5, 6]
    assert propose(seq, k=8, hi=3, factor=2.0) == [4, 5, 6, 10, 11, 12]
    # agreement past prompt_lookup_max counts: a 2-gram lookup, the same occurrence, the same 3 tokens
    assert propose(seq, k=8, hi=2, factor=1.0) == [4, 5, 6]
    assert propose(seq, k=8, hi=3, factor=0.3) == []
    # a copy under way agrees far back: k binds, not the factor
    block = list(range(100, 130))
    assert propose(block + block[:10], k=6, factor=1.0) == block[10:16]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(seq=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 8), lo=st.integers(1, 3), extra=st.integers(0, 3),
       factor=st.sampled_from([None, 0.5, 1.0, 1.5, 3.0]), max_tokens=st.integers(0, 9))
def test_matches_brute_force(seq, k, lo, extra, factor, max_tokens):
    got = NgramProposer(k, lo, lo + extra, factor).propose("r", seq, 0, max_tokens)
    assert got == reference(seq, k, lo, lo + extra, factor, max_tokens)
