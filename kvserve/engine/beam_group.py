"""BeamGroup: one beam-search request inside the engine (LLM.beam_search, the server's use_beam_search).

Each live beam is an engine Request decoding one token a step with the top 2 x beam_width logprobs. Once every
live beam has its step's logprobs, the group chooses the next beams as transformers' generate(num_beams=...,
do_sample=False) does with its defaults:

    candidates: the best 2 x beam_width (beam, token) by cumulative logprob
    live beams: the best beam_width candidates that do not end in EOS
    finished:   those among the best beam_width candidates that end in EOS (or reach max_tokens), scored
                cumulative logprob / generated length ** length_penalty; the best beam_width kept
    stop:       at max_tokens, or once beam_width are finished and the best live beam, scored at its current
                length, cannot beat the worst of them

A beam's first chosen child continues its Request with the chosen token in place of the one it sampled (whose KV
is not computed yet); every further child is a fork sharing all its blocks (KVCacheManager.fork), the partial last
block copied on the first write (copy-on-write): the prompt's KV is never copied. Beams nobody continues leave.
Until the group has chosen, a beam that sampled is held: the scheduler skips it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvserve.core.request import Request, RequestStatus
from kvserve.entrypoints.beam_search import BeamSearchParams
from kvserve.errors import InvalidRequestError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Candidate:
    parent: Request
    token: int
    cum_logprob: float


class BeamGroup:
    """The live beams (requests) and the finished hypotheses of one prompt's beam search."""

    def __init__(self, request_id: str, root: Request, params: BeamSearchParams, eos_token_ids: set[int],
                 block_size: int):
        self.request_id = request_id
        self.params = params
        self.block_size = block_size
        self.prompt_token_ids = root.prompt_token_ids
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.prompt_len = root.num_prompt_tokens
        self.live: dict[str, tuple[Request, float]] = {root.request_id: (root, 0.0)}   # id -> (beam, its logprob)
        self.finished: list[tuple[float, list[int], float]] = []   # (score, generated tokens, cum logprob)
        self.length = 0   # tokens every live beam has when the group last chose
        self.done = False
        self._ids = itertools.count(1)

    def is_ready(self) -> bool:
        """Every live beam has sampled its next token (or ended)."""
        return all(r.num_output_tokens > self.length or r.is_finished for r, _ in self.live.values())

    def advance(self, engine) -> None:
        """Choose the next beams from the live ones' logprobs; fork, retarget or drop requests to match."""
        width = self.params.beam_width
        candidates = [_Candidate(req, token, cum + lp.logprob) for req, cum in self.live.values()
                      for token, lp in req.logprobs[-1].items()]
        candidates.sort(key=lambda c: c.cum_logprob, reverse=True)
        candidates = candidates[:2 * width]
        self.length += 1
        last = self.length >= self.params.max_tokens
        ends = [last or c.token in self.eos for c in candidates]
        for cand, end in zip(candidates[:width], ends[:width]):
            if end:
                tokens = cand.parent.output_token_ids[:-1] + [cand.token]
                self.finished.append((cand.cum_logprob / self.length ** self.params.length_penalty, tokens,
                                      cand.cum_logprob))
        self.finished = sorted(self.finished, key=lambda f: f[0], reverse=True)[:width]
        chosen = [c for c, end in zip(candidates, ends) if not end][:width]
        best_live = chosen[0].cum_logprob / self.length ** self.params.length_penalty if chosen else None
        if last or not chosen or (len(self.finished) == width and self.finished[-1][0] >= best_live):
            chosen = []   # done: no live beam can improve on the finished ones
        self._continue(engine, chosen)
        self.done = not chosen

    def _continue(self, engine, chosen: list[_Candidate]) -> None:
        live, continued = {}, set()
        for cand in chosen:
            parent = cand.parent
            if parent.request_id not in continued:
                continued.add(parent.request_id)
                replace_last_token(parent, cand.token, self.block_size)
                beam = parent
            else:
                beam = fork_beam(engine, parent, self._new_id(engine), cand.token, self.block_size)
            beam.held = False
            live[beam.request_id] = (beam, cand.cum_logprob)
        dropped = [rid for rid in self.live if rid not in continued]
        engine.scheduler.finish_requests(dropped, RequestStatus.FINISHED_STOPPED)
        self.live = live

    def _new_id(self, engine) -> str:
        """'<id>#k' for the next beam, never an id a request in flight already has."""
        while True:
            request_id = f"{self.request_id}#{next(self._ids)}"
            if not engine.id_in_use(request_id):
                return request_id

    def output(self, prompt: str | None, tokenizer, metrics: dict, aborted: bool = False) -> RequestOutput:
        """The best beam_width sequences, best first (an aborted search: those finished so far)."""
        outs = []
        for i, (_, tokens, cum) in enumerate(self.finished):
            reason = "stop" if tokens and tokens[-1] in self.eos else "length"
            outs.append(CompletionOutput(index=i, text=tokenizer.decode(tokens, skip_special_tokens=True),
                                         token_ids=tokens, cumulative_logprob=cum, logprobs=None,
                                         finish_reason="abort" if aborted else reason))
        return RequestOutput(request_id=self.request_id, prompt=prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=None, outputs=outs, finished=True, metrics=metrics)


def beam_request_params(params: BeamSearchParams, speculative: bool) -> SamplingParams:
    """The sampling parameters of a beam search's requests: one token a step with 2 x beam_width logprobs (the
    group handles EOS and max_tokens)."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidRequestError(f"beam_search must be a BeamSearchParams, got {type(params).__name__}",
                                  "beam_search")
    params.validate()
    if speculative:
        raise InvalidRequestError("beam search does not run with speculative decoding", "use_beam_search")
    return SamplingParams(temperature=0, max_tokens=params.max_tokens, logprobs=2 * params.beam_width,
                          ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def advance_beam_groups(engine, updates: list[tuple[Request, list[int]]]) -> None:
    """After a step: every beam group one of whose beams sampled, and whose beams all have, chooses."""
    groups = {req.beam.request_id: req.beam for req, _ in updates if req.beam is not None}
    for group in groups.values():
        if not group.done and group.is_ready():
            group.advance(engine)


def replace_last_token(req: Request, token: int, block_size: int) -> None:
    """A beam continues with `token` where it sampled another (that position's KV is not computed yet)."""
    req.all_token_ids[-1] = token
    req.output_token_ids[-1] = token
    del req.block_hashes[(req.num_tokens - 1) // block_size:]   # no hash may cover the changed token


def fork_beam(engine, parent: Request, request_id: str, token: int, block_size: int) -> Request:
    """A new beam: the parent's tokens with `token` last, sharing the parent's blocks (copy-on-write)."""
    child = Request(request_id, parent.prompt_token_ids, parent.params, parent.eos_token_ids, parent.arrival_time,
                    parent.priority, parent.max_tokens, parent.cache_salt, parent.lora_request)
    child.all_token_ids = parent.all_token_ids[:-1] + [token]
    child.output_token_ids = parent.output_token_ids[:-1] + [token]
    child.beam = parent.beam
    child.block_hashes = parent.block_hashes[:(child.num_tokens - 1) // block_size]
    child.first_scheduled_time = parent.first_scheduled_time
    child.logprobs = list(parent.logprobs)
    child.num_cached_tokens = max(parent.num_cached_tokens, 0)
    child.accounting = type(parent.accounting)() if parent.accounting is not None else None
    engine.processor.add_child(engine.processor.children[parent.request_id].parent, child)   # abortable from here
    if child.lora_request is not None:   # each beam leaves the scheduler once: each unpins once
        engine.lora.pin(child.lora_id)
    scheduler = engine.scheduler
    scheduler.requests[request_id] = child
    if parent.status == RequestStatus.RUNNING:
        engine.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        scheduler.running.append(child)
    else:   # a preempted parent: the child computes its tokens again (the prefix cache helps), first in line
        scheduler.waiting.appendleft(child)
    return child
