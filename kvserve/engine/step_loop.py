"""LLMEngine's step: schedule, run the model, merge the sampled tokens into requests and outputs; with async
scheduling, each step launched behind the one in flight (kvserve/worker/step_pipeline.py). A step that raises
fails its own requests only."""
from __future__ import annotations

import concurrent.futures
import logging

from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import SchedulerOutput
from kvserve.engine.beam_group import advance_beam_groups
from kvserve.errors import EngineDeadError, KVServeError, RequestFailedError
from kvserve.outputs import RequestOutput
from kvserve.worker.step_pipeline import PendingStep

logger = logging.getLogger("kvserve")


class StepLoop:
    """LLMEngine's stepping (a mixin: the engine's scheduler, runner, processor and proposer)."""

    # ----- one iteration -----
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, detokenize; returns the outputs that changed.

        Requests that fail (their step's forward pass or output processing raised; one that can never fit the KV
        cache) are aborted and reported by take_failed_requests(); the others go on. With async scheduling the
        outputs are those of the step launched by the call before (kvserve/worker/step_pipeline.py)."""
        if self.accountant is not None:
            self.accountant.begin()
        if self.async_scheduling:
            return self._step_async()
        sched = self._schedule()
        if sched is None:
            return []
        parent_ids = self._parent_ids(sched)
        try:
            sampled = self.runner.execute_model(sched)
            if self.accountant is not None:
                self.accountant.step(self.scheduler, self.kv, sched.scheduled)
        except EngineDeadError:
            raise   # a tensor-parallel rank died: no step can run again
        except Exception as e:
            self._fail_step(sched, parent_ids, e)
            return []
        outputs = self._merge(sched, parent_ids, sampled)
        if self.proposer is not None:
            try:
                self._propose_drafts()
            except Exception:   # drafts are optional: the step's outputs stand, the next step runs without them
                logger.exception("kvserve: proposing drafts failed; the next step runs without them")
                for req in self.scheduler.running:
                    req.drop_drafts()
        return outputs

    def _schedule(self) -> SchedulerOutput | None:
        """The next step's schedule (its rejected requests failed), or None when nothing runs."""
        sched = self.scheduler.schedule()
        for req, error in sched.rejected:
            self._fail(req, error)
        return None if sched.is_empty else sched

    def _parent_ids(self, sched: SchedulerOutput) -> list[str]:
        # taken first: output processing drops a finished request's parent, even in a step that then fails
        return list(dict.fromkeys(p.request_id for req, _ in sched.scheduled
                                  if (p := self.processor.parent_of(req.request_id)) is not None))

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch the next step behind the one in flight, then wait for that one's tokens and merge
        them. The step in flight is finished first where the next one needs its tokens on the host
        (Request.needs_its_last_token, n > 1 samples still to fork). self._pending holds a step until its merge
        starts, and the next one before that: whatever raises, no launched step is forgotten."""
        pending = self._pending
        outputs = []
        if pending is not None and self._needs_tokens(pending):
            self._pending = None
            outputs, pending = self._finish(pending), None
        sched = self._schedule()
        if sched is None:
            self._pending = None
            if pending is None:
                self._wait_for_held_requests()
                return outputs
            return outputs + self._finish(pending)
        parent_ids = self._parent_ids(sched)
        try:
            launched = self.runner.launch(sched, pending)
            if self.accountant is not None:
                self.accountant.step(self.scheduler, self.kv, sched.scheduled)
            self.scheduler.commit(sched, launched.reqs)
            launched.parent_ids = parent_ids
        except EngineDeadError:
            raise
        except Exception as e:
            self._fail_step(sched, parent_ids, e)
            launched = None
        self._pending = launched
        if pending is not None:
            outputs += self._finish(pending)
        self._drop_finished_pending()
        return outputs

    def _drop_finished_pending(self) -> None:
        """Forget the launched step when every request in it has finished or was aborted since (its merge would
        pass them all over): nothing of it is waited for, and no finished request's state is held. On a GPU its
        tensors are freed in stream order, after the step."""
        pending = self._pending
        if pending is not None and all(r.is_finished for r, _ in pending.sched.scheduled):
            self._pending = None

    def _needs_tokens(self, pending: PendingStep) -> bool:
        forks = self.scheduler.fork_groups
        return any(not r.is_finished and (r.needs_its_last_token() or r.request_id in forks) for r in pending.reqs)

    def _finish(self, pending: PendingStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and merge them."""
        try:
            sampled = self.runner.finish_step(pending)
        except EngineDeadError:
            raise
        except Exception as e:
            self._fail_step(pending.sched, pending.parent_ids, e)
            return []
        return self._merge(pending.sched, pending.parent_ids, sampled, committed=True)

    def _merge(self, sched: SchedulerOutput, parent_ids: list[str], sampled: dict[str, list[int]],
               committed: bool = False) -> list[RequestOutput]:
        """A step's sampled tokens into its requests and outputs (update_from_output's `committed`)."""
        try:
            updates = self.scheduler.update_from_output(sched, sampled, committed)
            advance_beam_groups(self, updates)
            outputs, stopped, failed = self.processor.process(updates)
        except EngineDeadError:
            raise
        except Exception as e:
            self._fail_step(sched, parent_ids, e)
            return []
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for parent_id, e in failed.items():
            logger.error("kvserve: building the output of request %s failed; failing it", parent_id, exc_info=e)
            self._fail_parent(parent_id, RequestFailedError(f"the output of this request could not be built: "
                                                            f"{type(e).__name__}: {e}"))
        return outputs

    def _wait_for_held_requests(self) -> None:
        """Nothing ran: if requests wait for their grammars or adapters, give the compiling and loading threads the
        cores for a while rather than spinning through empty steps."""
        pending = self.scheduler.compiling_grammars() + (self.lora.loading() if self.lora else [])
        if pending:
            concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)

    def _propose_drafts(self) -> None:
        """Drafts for the next step of every decoding request, unless the batch is too big to gain from them.

        A request gets at most as many drafts as it may still emit tokens, less the one it always emits."""
        running = self.scheduler.running
        if not self.spec_config.is_enabled_for(len(running)):
            return
        k = self.spec_config.num_speculative_tokens
        adaptive = self.spec_config.adaptive_draft_length
        reqs, max_drafts = [], []
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1 or req.beam is not None:
                continue   # still in its prompt, or a beam (its next token is its group's choice)
            if adaptive:   # the scheduler shortens it after a rejection and lengthens it after a whole acceptance
                req.draft_len = k if req.draft_len is None else min(req.draft_len, k)
            reqs.append(req)
            max_drafts.append(min(req.draft_len if adaptive else k, req.max_tokens - req.num_output_tokens - 1,
                                  self.max_model_len - req.num_tokens - 1))
        for req, drafts in zip(reqs, self.proposer.propose_batch(reqs, max_drafts)):
            req.spec_token_ids = list(drafts)

    def _fail_step(self, sched, parent_ids: list[str], e: Exception) -> None:
        """Fail every request of a step that raised: only they are suspect; waiting ones stay queued."""
        logger.exception("kvserve: a step failed; failing its %d request(s)", len(parent_ids))
        error = RequestFailedError(f"the engine step running this request failed: {type(e).__name__}: {e}")
        for parent_id in parent_ids:
            self._fail_parent(parent_id, error)
        # a sample whose parent was already dropped still holds its blocks in the scheduler
        self.scheduler.finish_requests([req.request_id for req, _ in sched.scheduled], RequestStatus.FINISHED_ABORTED)

    def _fail(self, req: Request, error: KVServeError) -> None:
        """Abort the user request `req` belongs to (every sample of it) and remember why."""
        parent = self.processor.parent_of(req.request_id)
        if parent is not None:   # else an earlier sample of the same request already failed it
            self._fail_parent(parent.request_id, error)

    def _fail_parent(self, parent_id: str, error: KVServeError) -> None:
        self._failed[parent_id] = error
        self._abort(parent_id, build_output=False)   # its detokenizer may be what failed
