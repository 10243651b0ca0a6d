"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): model-free draft tokens from suffix trees.

Two trees of token suffixes, each cut to `max_tree_depth` tokens, with a count per node (how often its path
occurred): one per running request over its prompt and outputs so far, and one global tree over the outputs of the
last `max_cached_requests` finished requests. To draft, find the longest suffix of the sequence that a tree has
seen followed by something, then walk down taking the most frequent child while the running product of the
children's frequencies (an estimate of the chance that every draft token so far is accepted) stays at or above
`min_token_prob`. The draft is long where the continuation is predictable and short or empty where it is not; its
score, the sum of the running products, estimates how many tokens the target model will accept, and the tree with
the better score supplies the draft.

Cost: a new token extends the at most `max_tree_depth` suffixes ending at it, O(max_tree_depth) dict operations;
a proposal matches in O(max_tree_depth log max_tree_depth) and drafts in O(num_speculative_tokens x children per
node). The trees are uncompressed tries, so a request's tree holds up to `max_tree_depth` nodes per token.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvserve.errors import InvalidRequestError
from kvserve.spec_decode.config import MAX_SPEC_FACTOR, is_spec_factor, spec_len


class _Node:
    """A path from the root; `count` = how many times the path occurs in the sequences added."""

    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Every suffix of the sequences added, cut to `max_depth` tokens; a suffix trie with counts.

    A node's children's counts add up to the occurrences of its path that something follows: an occurrence at the
    end of a sequence (such as a request's latest tokens) has no continuation and adds to no child.
    """

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0   # not counting the root

    def extend(self, ends: list[_Node], token: int) -> list[_Node]:
        """Append `token` to a sequence whose suffixes end at `ends` and return the new ends.

        ends[j] is the node of the sequence's suffix of length j + 1. Only the last max_depth tokens can start a
        path that is still growing, so there are at most max_depth ends and a token costs O(max_depth):

            tokens  ... a b c d      ends = [d, cd, bcd, abcd]   (max_depth 4)
            + e     ... a b c d e    ends = [e, de, cde, bcde]   (abcd is full: abcde is never stored)
        """
        new_ends = []
        for node in (self.root, *ends[:self.max_depth - 1]):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            new_ends.append(child)
        return new_ends

    def add(self, token_ids: Sequence[int]) -> None:
        """Add every suffix of `token_ids`."""
        ends: list[_Node] = []
        for token in token_ids:
            ends = self.extend(ends, token)

    def remove(self, token_ids: Sequence[int]) -> None:
        """Undo add(token_ids): decrement each suffix's path and delete the nodes whose count reaches zero."""
        for start in range(len(token_ids)):
            path = token_ids[start:start + self.max_depth]
            node = self.root
            for depth, token in enumerate(path, 1):
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    # a child's count is at most its parent's, so below a node that was at 1 hangs only the rest
                    # of this path, each node at 1 too: drop it whole
                    del node.children[token]
                    self.num_nodes -= len(path) - depth + 1
                    break
                node = child

    def find(self, token_ids: Sequence[int]) -> _Node | None:
        """The node of the path `token_ids`, or None."""
        node = self.root
        for token in token_ids:
            node = node.children.get(token)
            if node is None:
                return None
        return node


def _longest_match(find: Callable[[int], _Node | None], lo: int, hi: int) -> tuple[_Node | None, int]:
    """(find(m), m) for the largest m in [lo, hi] that has a node, else (None, 0); find(m) is the node of the
    sequence's last m tokens when that node has children, else None.

    Binary search is exact: if the last m tokens occurred followed by a token, so did any shorter suffix of them (in
    the same occurrence, and within the depth limit since its path is shorter).
    """
    best, length = None, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        node = find(mid)
        if node is None:
            hi = mid - 1
        else:
            best, length, lo = node, mid, mid + 1
    return best, length


def _continued(node: _Node | None) -> _Node | None:
    return node if node is not None and node.children else None


def _draft(node: _Node | None, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent child from `node` (ties: the smaller token id); return the tokens and their score."""
    draft: list[int] = []
    score, prob = 0.0, 1.0
    while node is not None and node.children and len(draft) < max_tokens:
        total, best_token, best = 0, -1, None
        for token, child in node.children.items():
            total += child.count
            if best is None or child.count > best.count or (child.count == best.count and token < best_token):
                best_token, best = token, child
        prob *= best.count / total
        if prob < min_token_prob:
            break
        draft.append(best_token)
        score += prob
        node = best
    return draft, score


class _RequestTree:
    """One request's tree over the tokens it has seen, and the ends of their suffixes (SuffixTree.extend)."""

    __slots__ = ("tree", "token_ids", "ends")

    def __init__(self, max_depth: int):
        self.tree = SuffixTree(max_depth)
        self.token_ids: list[int] = []
        self.ends: list[_Node] = []

    def extends_seen(self, token_ids: Sequence[int]) -> bool:
        # Sequences only grow, or restart from the prompt (shorter). Checking the last max_depth tokens seen keeps
        # a step O(max_depth) instead of O(length); they are also all the ends depend on.
        num_seen = len(self.token_ids)
        start = max(0, num_seen - self.tree.max_depth)
        return len(token_ids) >= num_seen and list(token_ids[start:num_seen]) == self.token_ids[start:]

    def update(self, token_ids: Sequence[int]) -> None:
        for token in token_ids[len(self.token_ids):]:
            self.ends = self.tree.extend(self.ends, token)
            self.token_ids.append(token)


class SuffixProposer:
    """Suffix-decoding drafts from a per-request suffix tree and a global tree over finished requests' outputs."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 min_token_prob: float = 0.1, min_match_len: int = 1, max_spec_factor: float | None = None):
        def bad(msg, param):
            raise InvalidRequestError(msg, param)
        if num_speculative_tokens < 1:
            bad(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}", "num_speculative_tokens")
        if max_tree_depth < 2:
            bad(f"max_tree_depth must be >= 2, got {max_tree_depth}", "max_tree_depth")
        if max_cached_requests < 0:
            bad(f"max_cached_requests must be >= 0, got {max_cached_requests}", "max_cached_requests")
        if not 0 <= min_token_prob <= 1:
            bad(f"min_token_prob must be in [0, 1], got {min_token_prob}", "min_token_prob")
        if not 1 <= min_match_len < max_tree_depth:
            bad(f"min_match_len must be in [1, max_tree_depth - 1], got {min_match_len}", "min_match_len")
        if not is_spec_factor(max_spec_factor):
            bad(f"max_spec_factor must be a number in (0, {MAX_SPEC_FACTOR}] or None, got {max_spec_factor!r}",
                "max_spec_factor")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.min_match_len = min_match_len
        self.max_spec_factor = max_spec_factor
        # per draft limit 0..k, the depth the match leaves the draft (see propose): fixed by the settings
        self._rooms = list(range(num_speculative_tokens + 1)) if max_spec_factor is None else [
            self._room(limit) for limit in range(num_speculative_tokens + 1)]
        self.global_tree = SuffixTree(max_tree_depth)
        self._cached_outputs: deque[list[int]] = deque()   # oldest first, evicted FIFO
        self._requests: dict[str, _RequestTree] = {}

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached_outputs)

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Draft tokens to follow `token_ids` (the request's whole sequence so far: prompt then outputs), at most
        min(max_tokens, num_speculative_tokens); [] when nothing matches well enough."""
        req = self._requests.get(request_id)
        if req is None or not req.extends_seen(token_ids):
            req = self._requests[request_id] = _RequestTree(self.max_tree_depth)
        req.update(token_ids)

        limit = min(max_tokens, self.num_speculative_tokens)
        if limit <= 0:
            return []
        # A path holds at most max_tree_depth tokens, match and draft together: leave room for `limit` draft tokens
        # (else a long repeat would match max_tree_depth - 1 tokens and draft one), or, where drafts are at most
        # max_spec_factor x the match, for the longest draft a match and its draft can share the depth with.
        room = self._rooms[limit]
        lo = self.min_match_len
        hi = min(len(token_ids), max(self.max_tree_depth - room, lo))
        if hi < lo:
            return []
        ends = req.ends
        draft, score = self._draft(*_longest_match(lambda m: _continued(ends[m - 1]), lo, hi), limit)
        if self.global_tree.root.children:
            found = _longest_match(lambda m: _continued(self.global_tree.find(token_ids[-m:])), lo, hi)
            global_draft, global_score = self._draft(*found, limit)
            if global_score > score:
                return global_draft
        return draft

    def _room(self, limit: int) -> int:
        """The longest draft of at most `limit` tokens that any match of m tokens allows (max_spec_factor x m, and
        the max_tree_depth - m the path has left)."""
        return max(min(limit, spec_len(self.max_spec_factor, m), self.max_tree_depth - m)
                   for m in range(1, self.max_tree_depth))

    def _draft(self, node: _Node | None, match_len: int, limit: int) -> tuple[list[int], float]:
        """The draft from a match of `match_len` tokens: at most max_spec_factor x match_len tokens (a short match
        is weak evidence), then as _draft."""
        if self.max_spec_factor is not None:
            limit = min(limit, spec_len(self.max_spec_factor, match_len))
        return _draft(node, limit, self.min_token_prob)

    def finish(self, request_id: str, token_ids: Sequence[int] | None, num_prompt_tokens: int) -> None:
        """The request ended: drop its own tree; when token_ids is given, add its output (token_ids[num_prompt_tokens:])
        to the global tree."""
        self._requests.pop(request_id, None)
        if token_ids is None or self.max_cached_requests == 0:
            return
        output = list(token_ids[num_prompt_tokens:])
        if not output:
            return
        self.global_tree.add(output)
        self._cached_outputs.append(output)
        if len(self._cached_outputs) > self.max_cached_requests:
            self.global_tree.remove(self._cached_outputs.popleft())
