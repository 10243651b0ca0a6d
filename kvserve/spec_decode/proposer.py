"""The proposers behind one interface: propose_batch(requests, max drafts each) -> draft token ids per request."""
from __future__ import annotations

from kvserve.core.request import Request, RequestStatus
from kvserve.spec_decode.config import SpeculativeConfig


class TokenProposer:
    """A proposer that guesses from token ids alone (n-gram, suffix), adapted to the engine's batch interface."""

    def __init__(self, lookup):
        self.lookup = lookup   # propose(request_id, token_ids, num_prompt_tokens, max_tokens) and finish(...)

    def propose_batch(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        return [self.lookup.propose(r.request_id, r.all_token_ids, r.num_prompt_tokens, n) if n > 0 else []
                for r, n in zip(reqs, max_drafts)]

    def finish(self, req: Request) -> None:
        """`req` left the engine: forget it; its output may inform later proposals (suffix decoding)."""
        aborted = req.status == RequestStatus.FINISHED_ABORTED   # cut short: no output worth learning from
        self.lookup.finish(req.request_id, None if aborted else req.all_token_ids, req.num_prompt_tokens)


class DraftModelProposer:
    """A smaller model of the same vocabulary, run by the model runner next to the target."""

    def __init__(self, runner):
        self.runner = runner

    def propose_batch(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        return self.runner.propose_drafts(reqs, max_drafts)

    def finish(self, req: Request) -> None:
        """The draft's KV lives in the request's blocks: nothing else to forget."""


def build_proposer(config: SpeculativeConfig, runner):
    """The proposer `config` names; the draft model itself is loaded by the engine and run by `runner`."""
    if config.method == "draft_model":
        return DraftModelProposer(runner)
    if config.method == "ngram":
        from kvserve.spec_decode.ngram import NgramProposer
        return TokenProposer(NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                           config.prompt_lookup_max, config.max_spec_factor))
    from kvserve.spec_decode.suffix import SuffixProposer
    return TokenProposer(SuffixProposer(config.num_speculative_tokens, config.suffix_max_tree_depth,
                                        config.suffix_max_cached_requests, config.suffix_min_token_prob,
                                        max_spec_factor=config.max_spec_factor))
