"""Scheduler: continuous batching with one token budget per step.

Every step: running requests first (decodes and unfinished prefill chunks), then waiting ones, while
the token budget (max_num_batched_tokens) and max_num_seqs allow. A prompt longer than what is left
of the budget is split into chunks across steps (chunked prefill), so decodes never stall behind it.
When the pool has no block for a running request, the lowest-priority running request is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue.

Under the priority policy a waiting request also preempts running ones that rank below it, and waiting ages a
request: every `priority_aging_s` seconds since its arrival count as one priority level, so a steady stream of
higher-priority requests cannot starve a lower one (see Scheduler.rank).

A waiting request that can never run (more tokens than the whole pool holds, or, without chunked prefill, than
a step's budget) is taken off the queue and reported in SchedulerOutput.rejected: it never blocks the queue head.
The engine refuses such requests when they arrive; this holds whatever reaches the queue.

A request with structured outputs waits until its grammar has compiled (on another thread); the requests behind
it are scheduled meanwhile. One whose grammar fails to compile, or not in time, is rejected the same way.

With LoRA, the running requests use at most `max_loras` different adapters (adapters still loading for waiting
requests count): a waiting request whose adapter would be one too many, or is still loading from disk
(`lora_ready`), keeps its place while the requests behind it that fit go first; after LORA_MAX_WAIT_S without a
slot it stops them, so that it cannot starve. One whose adapter fails to load is rejected.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler_stats import SchedulerStats, SpecDecodingStats
from kvserve.errors import ContextLengthExceededError, KVServeError


# a waiting request held this long for a LoRA slot stops the requests behind it from starting, until it starts
LORA_MAX_WAIT_S = 1.0


@dataclass
class SchedulerOutput:
    """What one step computes: requests in batch order with their number of new tokens."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, KVServeError]] = field(default_factory=list)   # (request, why it can never run)
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write, before the forward
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides every step which requests run and how many tokens each computes."""

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", enable_chunked_prefill: bool = True,
                 priority_aging_s: float | None = None, max_loras: int | None = None,
                 lora_ready: Callable[[Request], bool] | None = None):
        self.kv = kv_cache_manager
        self.max_loras = max_loras
        self.lora_ready = lora_ready   # True when a request's adapter is loaded; raises KVServeError if it cannot be
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.priority_aging_s = priority_aging_s
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # n > 1: siblings wait for the first sample's prompt, then share its blocks (fork)
        self.fork_groups: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec_stats = SpecDecodingStats()
        self.on_finished: Callable[[Request], None] | None = None   # told of every request that leaves

    # ----- requests in and out -----
    def add_request(self, req: Request, siblings: list[Request] = ()) -> None:
        """Queue a request; `siblings` (more samples of the same prompt) start once its prompt is computed."""
        self.requests[req.request_id] = req
        self._enqueue(req)
        if siblings:
            self.fork_groups[req.request_id] = list(siblings)
            self.requests.update((s.request_id, s) for s in siblings)

    def _enqueue(self, req: Request) -> None:
        if self.policy == "priority":
            self._insert_by_priority(req)
        else:
            self.waiting.append(req)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Finish (stop or abort) requests wherever they are; frees their blocks at once."""
        done = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.kv.free(req)
            if not req.is_finished:
                req.status = status
            if self.on_finished is not None:
                self.on_finished(req)
            for sibling in self.fork_groups.pop(rid, ()):
                if not sibling.is_finished:   # nothing to fork from: compute the prompt itself
                    self._enqueue(sibling)
            done.append(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def rank(self, req: Request) -> tuple[float, float]:
        """Order under the priority policy, lowest first.

        With aging, a request's effective priority after waiting w seconds is priority - w / priority_aging_s.
        Between two requests the common clock cancels out, so priority + arrival_time / priority_aging_s orders
        them the same at every moment: the key never changes and the queue stays sorted."""
        if self.priority_aging_s:
            return req.priority + req.arrival_time / self.priority_aging_s, req.arrival_time
        return req.priority, req.arrival_time

    # ----- one step -----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        out.block_copies = self.kv.take_block_copies()
        # decodes first, then prefill chunks: the attention backend groups them that way
        out.scheduled.sort(key=lambda item: item[1] > 1)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            # a beam waiting for its group's choice, or (async scheduling) a request whose last token is in flight
            if req.held or self._capped_in_flight(req):
                i += 1
                continue
            num_new = self._num_new_tokens(req, budget)
            if num_new == 0:   # async scheduling: a pooling request whose last chunk is in flight
                i += 1
                continue
            while self.kv.allocate_slots(req, num_new) is None:
                if req.spec_token_ids:   # drafts are worth no preemption: drop them first, then everyone's
                    req.drop_drafts()
                    num_new = self._num_new_tokens(req, budget)
                    continue
                freed = self._drop_drafts(out)
                if freed is not None:
                    budget += freed
                    continue
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                budget += self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue   # req itself was preempted; the same index now holds the next request
            out.scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _drop_drafts(self, out: SchedulerOutput) -> int | None:
        """Drop every running request's drafts, the step's included, and free the blocks only drafts used.

        Returns the tokens given back to the step's budget, or None when there was nothing to drop."""
        freed, changed = 0, False
        for r in self.running:
            num_drafts = len(r.spec_token_ids)
            r.drop_drafts()
            for j, (scheduled, n) in enumerate(out.scheduled):
                if scheduled is r and num_drafts:
                    out.scheduled[j] = (r, n - num_drafts)
                    freed += num_drafts
            changed |= num_drafts > 0
            changed |= self.kv.free_tail(r, r.num_tokens + r.num_placeholders) > 0
        return freed if changed else None

    def _capped_in_flight(self, req: Request) -> bool:
        """Async scheduling: the token in flight is the request's last (max_tokens, or the context is full)."""
        return bool(req.num_placeholders) and (
            req.num_output_tokens + req.num_placeholders >= req.max_tokens
            or req.num_tokens + req.num_placeholders >= self.max_model_len)

    @staticmethod
    def _num_new_tokens(req: Request, budget: int) -> int:
        """Tokens `req` computes this step: the rest of its tokens and its drafts, as far as the budget goes
        (drafts the budget cuts off are dropped)."""
        num_left = req.num_tokens + req.num_placeholders - req.num_computed_tokens
        num_new = min(num_left + len(req.spec_token_ids), budget)
        del req.spec_token_ids[max(num_new - num_left, 0):]
        return num_new

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        held = []   # requests whose grammar or adapter is not ready: they keep their place, the others go first
        # adapters of the running requests, and of held requests whose adapter loads: both count towards max_loras
        running_adapters, loading = self._running_adapters(), set()
        now = time.monotonic()
        while self.waiting and budget > 0:
            req = self.waiting[0]
            error = self._why_it_can_never_run(req)
            ready, block = True, False
            if req.held or req.num_placeholders:   # a preempted beam waiting for its group's choice, or a request
                held.append(self.waiting.popleft())   # preempted with a token in flight (async scheduling)
                continue
            try:   # asked once: the compilation or load may end (or fail) at any moment
                if error is None and req.structured_output is not None:
                    ready = req.structured_output.is_ready()
                if error is None and ready and req.lora_request is not None:
                    ready, block = self._lora_admissible(req, running_adapters, loading, now)
            except KVServeError as e:   # the constraint's or adapter's fault (400), or the compiler's (500)
                error = e
            if error is not None:
                self.waiting.popleft()
                out.rejected.append((req, error))
                continue
            if not ready:
                held.append(self.waiting.popleft())
                if block:
                    break
                continue
            if len(self.running) >= self.max_num_seqs:
                freed = self._make_room(req, out)
                if freed is None:
                    break
                budget += freed
                running_adapters = self._running_adapters()
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget and (not self.enable_chunked_prefill or (req.pooling and req.pooling.whole)):
                break   # the whole prompt in one step: an encoder's sequence attends to all of itself
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                freed = self._make_room(req, out)
                if freed is None:
                    break
                budget += freed
                running_adapters = self._running_adapters()
                continue
            self.waiting.popleft()
            if req.num_cached_tokens < 0:   # counted once, at first scheduling
                req.num_cached_tokens = num_hit_tokens
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            if req.lora_id is not None:
                running_adapters.add(req.lora_id)
                req.lora_wait_start = None
            out.scheduled.append((req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(held))

    def _running_adapters(self) -> set[int]:
        return {r.lora_id for r in self.running if r.lora_id is not None}

    def _lora_admissible(self, req: Request, running: set[int], loading: set[int], now: float) -> tuple[bool, bool]:
        """(ready, block): whether `req`'s adapter lets it start now, and, when not, whether the requests behind it
        must wait too. It starts when its adapter is in memory and among the running ones or those loading for
        requests ahead, or a slot is free beside them. One held for a slot LORA_MAX_WAIT_S stops the requests
        behind it, so that the running adapters drain and it cannot starve."""
        adapters = running | loading
        if self.max_loras is not None and req.lora_id not in adapters and len(adapters) >= self.max_loras:
            if req.lora_wait_start is None:
                req.lora_wait_start = now
            return False, now - req.lora_wait_start >= LORA_MAX_WAIT_S
        if self.lora_ready is not None and not self.lora_ready(req):
            loading.add(req.lora_id)   # its load takes a slot: the requests behind may not take it meanwhile
            return False, False
        return True, False

    def _why_it_can_never_run(self, req: Request) -> ContextLengthExceededError | None:
        """Why `req` could not run even alone on an empty pool; None when it can."""
        num_blocks = self.kv.blocks_needed(req.num_tokens, self.max_num_batched_tokens)
        why = None
        if num_blocks > self.kv.num_usable_blocks:
            why = (f"its {req.num_tokens} tokens need {num_blocks} KV blocks, but the whole KV cache has "
                   f"{self.kv.num_usable_blocks}")
        elif not self.enable_chunked_prefill and req.num_tokens > self.max_num_batched_tokens:
            why = (f"its {req.num_tokens} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens} and "
                   "chunked prefill is off")
        if why is None:
            return None
        return ContextLengthExceededError(f"the request can never be scheduled: {why}", "prompt")

    def compiling_grammars(self) -> list:
        """The grammar futures of waiting requests whose grammar is still compiling."""
        return [r.structured_output.grammar for r in self.waiting
                if r.structured_output is not None and not r.structured_output.grammar.done()]

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=self.rank)
        return self.running[-1]

    def _preempt_lower(self, req: Request, out: SchedulerOutput) -> int | None:
        """Priority policy: preempt the lowest-ranked running request if it ranks below the waiting `req`.

        Returns the tokens it gives back to the step's budget, or None when there is no such request. Ranks are
        static and the victim ranks strictly below `req`, so two requests never preempt each other in turn."""
        if self.policy != "priority" or not self.running:
            return None
        victim = self._pick_victim()
        if self.rank(victim) <= self.rank(req):
            return None
        return self._preempt(victim, out)

    def _make_room(self, req: Request, out: SchedulerOutput) -> int | None:
        """A seat or blocks for the waiting `req`: a lower-ranked running request preempted, else a held beam (held
        beams must not fill every seat and block their group's other beams need); the tokens given back, or None."""
        freed = self._preempt_lower(req, out)
        return freed if freed is not None else self._preempt_held(out)

    def _preempt_held(self, out: SchedulerOutput) -> int | None:
        """Preempt the latest running beam that waits for its group's choice (it computes nothing until then): the
        room it holds may be what the group's other beams need to sample."""
        held = [r for r in self.running if r.held]
        return self._preempt(held[-1], out) if held else None

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Preempt: free the blocks (cached ones stay findable: in the pool until handed out again, then in the host
        tier under preemption_mode swap), forget computed tokens, requeue at the front.

        Returns the tokens it had been given this step (now back in the budget)."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.drop_drafts()
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)
        out.preempted.append(req)
        for j, (r, n) in enumerate(out.scheduled):
            if r is req:
                del out.scheduled[j]
                return n
        return 0

    def _insert_by_priority(self, req: Request) -> None:
        key = self.rank(req)
        for i, other in enumerate(self.waiting):
            if key < self.rank(other):
                self.waiting.insert(i, req)
                return
        self.waiting.append(req)

    # ----- merge the model's output -----
    def commit(self, out: SchedulerOutput, sampling: list[Request]) -> None:
        """Async scheduling: take the step `out` as computed once it is launched, before its tokens are known, so
        that the next step can be scheduled behind it; each request of `sampling` holds a placeholder for its token
        until update_from_output(out, ..., committed=True) appends it."""
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
        for req in sampling:
            req.num_placeholders += 1

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]], committed: bool = False
                           ) -> list[tuple[Request, list[int]]]:
        """Advance computed tokens, append sampled tokens, apply token-level stops; returns (req, new tokens).

        `sampled` holds, per request that reached the end of its tokens, the tokens it emits: one, or with drafts
        the accepted drafts and one more (1 .. k + 1). Tokens after a stop are dropped. `committed`: the step was
        committed at launch (async scheduling; no drafts): its computed tokens are counted already, and a request
        finished or aborted since (its token in flight no longer wanted) is passed over."""
        now = time.monotonic()
        updates = []
        for req, num_new in out.scheduled:
            if committed:
                if req.request_id in sampled and req.pooling is None:   # a pooling request holds none
                    req.num_placeholders -= 1
                if req.is_finished:
                    continue
            num_drafts = len(req.spec_token_ids)
            req.drop_drafts()
            tokens = sampled.get(req.request_id)
            if not committed:
                req.num_computed_tokens += num_new
            if tokens is None:   # a prefill chunk that did not reach the end of the prompt
                self.kv.cache_computed_blocks(req)
                continue
            if req.pooling is not None:   # its vector is complete: it emits no token
                self.kv.cache_computed_blocks(req)
                req.status = RequestStatus.FINISHED_STOPPED
                req.first_token_time = req.last_token_time = now
                self._finish(req)
                updates.append((req, []))
                continue
            if num_drafts:
                accepted = len(tokens) - 1
                self.spec_stats.record(num_drafts, accepted)
                # adaptive draft length: after a rejection the run just accepted and one more, after a whole
                # acceptance one more than before (the engine caps it at k)
                if req.draft_len is not None:
                    req.draft_len = accepted + 1 if accepted < num_drafts else req.draft_len + 1
                # the KV of the first rejected draft and of every draft after it is stale
                req.num_computed_tokens -= num_drafts - accepted
            new_tokens = self._append_tokens(req, tokens)
            if len(new_tokens) < len(tokens):   # a stop: the logprobs of the tokens after it go too
                req.truncate_output(req.num_output_tokens)
            # after a stop, fewer tokens than computed may remain; what is left is all computed (committed: the
            # step behind this one computes the token just appended, its placeholder)
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens + req.num_placeholders)
            self.kv.cache_computed_blocks(req)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            req.held = req.beam is not None and not req.is_finished
            if req.is_finished:
                self._finish(req)
            updates.append((req, new_tokens))
        return updates

    def _append_tokens(self, req: Request, tokens: list[int]) -> list[int]:
        """Append tokens one by one until one stops the request; returns the ones appended."""
        so = req.structured_output
        for i, token in enumerate(tokens):
            req.append_output_token(token)
            if req.request_id in self.fork_groups:
                self._fork(req)   # before a stop check can free the prompt's blocks
            if req.check_stop(self.max_model_len):
                return tokens[:i + 1]
            if so is not None and not (so.accept(token) and not so.is_terminated):
                # the grammar ended (its stop token, under ignore_eos), or a conflict broke it (see accept)
                req.status = RequestStatus.FINISHED_STOPPED
                return tokens[:i + 1]
        return tokens

    def _fork(self, req: Request) -> None:
        """Start the siblings on `req`'s blocks; each recomputes the last prompt token to sample its own."""
        for sibling in self.fork_groups.pop(req.request_id):
            if sibling.is_finished:
                continue
            self.kv.fork(req, sibling)
            sibling.num_computed_tokens = req.num_prompt_tokens - 1
            sibling.num_cached_tokens = max(req.num_cached_tokens, 0)
            sibling.status = RequestStatus.RUNNING
            sibling.first_scheduled_time = time.monotonic()
            self.running.append(sibling)

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        else:   # async scheduling: preempted while its last token was in flight
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        self.kv.free(req)
        if self.on_finished is not None:
            self.on_finished(req)

    def stats(self) -> SchedulerStats:
        tier, connector = self.kv.tier, self.kv.connector
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage(), self.num_preemptions,
                              self.prefix_cache_queries, self.prefix_cache_hits, self.spec_stats.copy(),
                              *self._lora_stats(), *((tier.num_saved, tier.num_loaded) if tier else (0, 0)),
                              *((connector.num_saved, connector.num_loaded, connector.transfer_seconds)
                                if connector else (0, 0, 0.0)))

    def _lora_stats(self) -> tuple[set[int], set[int]]:
        """The adapters of the running and of the waiting requests (none looked for without LoRA)."""
        if self.max_loras is None:
            return set(), set()
        return self._running_adapters(), {r.lora_id for r in self.waiting if r.lora_id is not None}
