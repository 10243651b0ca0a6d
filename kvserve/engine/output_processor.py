"""OutputProcessor: detokenizes each request's new tokens, applies stop strings, builds RequestOutputs.

A user request with n > 1 is a parent of n child Requests (ids "0_<id>", "1_<id>", ...); its
RequestOutput carries one CompletionOutput per child, in index order.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvserve.core.request import Request, RequestStatus
from kvserve.engine.detokenizer import IncrementalDetokenizer, detokenize_logprobs
from kvserve.engine.accounting import accounting_metrics
from kvserve.engine.pooling import pooling_output
from kvserve.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("kvserve")


@dataclass
class ChildState:
    req: Request
    detok: IncrementalDetokenizer
    parent: ParentState = field(repr=False, compare=False)   # the user request it is a sample (or beam) of
    num_tokens_sent: int = 0
    num_logprobs_sent: int = 0
    finish_sent: bool = False


@dataclass
class ParentState:
    """Frontend state of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState] = field(default_factory=list)
    beam: object = None   # a beam search's BeamGroup (kvserve/engine/beam_group.py)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(c.req.is_finished for c in self.children)


class OutputProcessor:
    """Maps engine updates to user-facing RequestOutputs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}   # request id of a child -> its state

    def add(self, parent: ParentState, children: list[Request]) -> None:
        for req in children:
            self._add_child(parent, req)
        self.parents[parent.request_id] = parent

    def add_child(self, parent: ParentState, req: Request) -> None:
        """A child that joins a running parent (a beam search's fork)."""
        self._add_child(parent, req)

    def _add_child(self, parent: ParentState, req: Request) -> None:
        child = ChildState(req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params), parent)
        parent.children.append(child)
        self.children[req.request_id] = child

    def parent_of(self, request_id: str) -> ParentState | None:
        """The user request a child request (a sample or beam) belongs to, while it is in flight."""
        child = self.children.get(request_id)
        return None if child is None else child.parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.req.request_id for c in parent.children] if parent else []

    def process(self, updates: list[tuple[Request, list[int]]]
                ) -> tuple[list[RequestOutput], list[str], dict[str, Exception]]:
        """Detokenize updates; returns the outputs to emit, the child ids a stop string finished, and the parents
        whose output could not be built (parent id -> error; the caller fails them, the others are unaffected)."""
        touched: dict[str, ParentState] = {}
        stopped: list[str] = []
        failed: dict[str, Exception] = {}
        for req, new_tokens in updates:
            child = self.children[req.request_id]
            parent = child.parent
            if parent.request_id in failed:
                continue
            if parent.beam is not None:   # its BeamGroup builds the output, once
                touched[parent.request_id] = parent
                continue
            try:
                stop_str = child.detok.update(new_tokens, req.status == RequestStatus.FINISHED_STOPPED)
            except Exception as e:   # a token this tokenizer cannot decode fails its own request only
                failed[parent.request_id] = e
                continue
            if stop_str is not None:
                req.truncate_output(child.detok.num_output_tokens)   # tokens after the stop string's are dropped
                if not req.is_finished:
                    stopped.append(req.request_id)
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop_str
            if parent.params.output_kind != RequestOutputKind.FINAL_ONLY or req.is_finished:
                touched[parent.request_id] = parent   # a FINAL_ONLY parent has an output only once one finishes
        outputs = []
        for parent in touched.values():
            if parent.request_id in failed:
                continue
            try:
                out = self.make_output(parent)   # raises before it drops a finished parent
            except Exception as e:
                failed[parent.request_id] = e
                continue
            if out is not None:
                outputs.append(out)
        return outputs, stopped, failed

    def make_output(self, parent: ParentState, force: bool = False) -> RequestOutput | PoolingRequestOutput | None:
        finished = parent.finished
        first = parent.children[0]
        if parent.beam is not None:
            if not parent.beam.done and not force:
                return None
            self._drop(parent)
            return parent.beam.output(parent.prompt, self.tokenizer, _metrics(first.req),
                                      aborted=not parent.beam.done)
        if first.req.pooling is not None:   # one vector, once, when it is done (or aborted: no vector)
            if not finished and not force:
                return None
            self._drop(parent)
            return pooling_output(parent.request_id, parent.prompt, first.req, finished, _metrics(first.req))
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished and not force:
            return None
        delta = kind == RequestOutputKind.DELTA
        # a delta carries only the samples that changed: new tokens, or the step that finished them
        outs = [self._completion(i, c, delta) for i, c in enumerate(parent.children) if not delta or _changed(c)]
        prompt_logprobs = self._prompt_logprobs(first)
        if finished:
            self._drop(parent)
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=outs, finished=finished,
            num_cached_tokens=max(first.req.num_cached_tokens, 0), metrics=_metrics(first.req))

    def _completion(self, index: int, c: ChildState, delta: bool) -> CompletionOutput:
        req = c.req
        finished = req.is_finished
        text = c.detok.get_next_output_text(finished, delta)
        tokens = req.output_token_ids[c.num_tokens_sent:] if delta else list(req.output_token_ids)
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = req.logprobs[c.num_logprobs_sent:] if delta else list(req.logprobs)
            detokenize_logprobs(self.tokenizer, logprobs)
        if delta:
            c.num_tokens_sent = req.num_output_tokens
            c.num_logprobs_sent = len(req.logprobs)
            c.finish_sent = finished
        return CompletionOutput(
            index=index, text=text, token_ids=tokens,
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=logprobs, finish_reason=req.status.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None)

    def _prompt_logprobs(self, child: ChildState):
        req = child.req
        if req.params.prompt_logprobs is None or not req.prompt_logprobs:
            return None
        detokenize_logprobs(self.tokenizer, req.prompt_logprobs)
        return req.prompt_logprobs

    def abort(self, request_id: str, build_output: bool = True) -> RequestOutput | None:
        """Mark a parent's children aborted and return its final output; without `build_output` just forget the
        parent (a failed request: its detokenizer may be what failed). An output that cannot be built (a FINAL_ONLY
        request's text is decoded only now) is logged and the parent forgotten: the caller gave it up, so there is
        nobody to report it to."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for c in parent.children:
            if not c.req.is_finished:
                c.req.status = RequestStatus.FINISHED_ABORTED
        if build_output:
            try:
                return self.make_output(parent, force=True)
            except Exception:
                logger.exception("kvserve: building the output of aborted request %s failed; dropped", request_id)
        self._drop(parent)
        return None

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for c in parent.children:
            self.children.pop(c.req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.parents)


def _changed(c: ChildState) -> bool:
    """A delta is due: new tokens since the last one, or the finish not yet reported."""
    return not c.finish_sent and (c.req.is_finished or c.req.num_output_tokens > c.num_tokens_sent)


def _metrics(req: Request) -> dict:
    metrics = {"arrival_time": req.arrival_time, "first_scheduled_time": req.first_scheduled_time,
               "first_token_time": req.first_token_time, "last_token_time": req.last_token_time,
               "num_preemptions": req.num_preemptions}
    if req.accounting is not None:
        metrics["accounting"] = accounting_metrics(req)
    return metrics
