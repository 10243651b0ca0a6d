"""Request: one sequence's state as the scheduler and the model runner see it.

    all_token_ids:  | prompt ............................ | outputs ........ |
    num_computed_tokens:  ---------------------------->|        (KV written)
    num_tokens = len(all_token_ids); the next step computes [num_computed_tokens, num_tokens)
    (a prefill chunk stops short of num_tokens; only a step that reaches the end samples a token)

With speculative decoding a decoding request also carries draft tokens guessed by a proposer:

    all_token_ids:  | prompt ......... | outputs ... t | spec_token_ids d1 .. dk |
    num_computed_tokens:  ------------------------->|      (t is the last sampled token)
    the step computes t, d1 .. dk (k + 1 rows); the sampler verifies the drafts and emits 1 .. k + 1 tokens;
    num_computed_tokens then falls back to just before the first token whose KV was computed from a rejected
    draft, so that KV is overwritten later and never hashed into the prefix cache
"""
from __future__ import annotations

import enum
import sys
import time

import torch

from kvserve.sample.metadata import SamplingRow
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset((RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
                       RequestStatus.FINISHED_ABORTED))
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}


class Request:
    """A single sequence being generated (a parent request with n > 1 fans out into n of these)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int] | None = None, arrival_time: float | None = None, priority: int = 0,
                 max_tokens: int | None = None, cache_salt: str | None = None, lora_request=None,
                 device: torch.device | str | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids or set()
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.priority = priority
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        self.cache_salt = cache_salt
        self.lora_request = lora_request   # kvserve.lora.LoRARequest: the adapter it runs with; None: the base model
        self.lora_wait_start: float | None = None   # when it first waited for a LoRA slot (scheduler)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # async scheduling: tokens sampled by the step in flight, not yet appended (their KV is computed next)
        self.num_placeholders = 0
        self.spec_token_ids: list[int] = []   # drafts to verify in the next step (speculative decoding)
        # [>= len(spec_token_ids), V]: the distributions q the drafts were drawn from; None: deterministic drafts
        self.spec_draft_probs: torch.Tensor | None = None
        # draft model: its KV is written for the positions below min(draft_kv_end, num_computed_tokens), those of
        # prefix-cache hits included (no limit until its first forward; model_runner._write_draft_kv)
        self.draft_kv_end = sys.maxsize
        # adaptive draft length: the most drafts the next proposal may make (None: the configured k)
        self.draft_len: int | None = None
        # a draft model with a cut vocabulary: the request's tokens past the cut (spec_decode.draft_vocab), from its
        # first proposal on
        self.draft_vocab = None
        self.structured_output = None        # StructuredOutputRequest when the output is constrained
        # a pooling request (LLM.embed): its PoolingState (kvserve/worker/pooling.py); it emits no token and finishes
        # when its prompt is computed
        self.pooling = None
        # beam search (kvserve/engine/beam_group.py): the BeamGroup this beam belongs to; held from its sample until
        # the group has chosen the next beams (the scheduler skips it)
        self.beam = None
        self.held = False
        self.accounting = None   # RequestAccounting with enable_request_accounting (kvserve/engine/accounting.py)
        self.num_cached_tokens = -1          # prefix-cache hit at first scheduling; -1 = not yet scheduled
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # on the device that samples, so that drawing its noise needs no copy (and no sync) each step
        self.generator = (torch.Generator(device=device or "cpu").manual_seed(params.seed)
                          if params.seed is not None else None)
        self.block_hashes: list = []         # chained hashes of the full blocks, filled by the KV cache manager
        # logprobs collected by the model runner
        self.logprobs: list = []
        self.prompt_logprobs: list = []
        self.num_prompt_logprobs_done = 0
        self.cumulative_logprob = 0.0
        # timing, for metrics
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def lora_id(self) -> int | None:
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED   # (status.is_finished, without its call: asked several times a step)

    def needs_its_last_token(self) -> bool:
        """Whether the next step's sampling or scheduling depends on the token the step in flight samples (async
        scheduling waits for it): penalties, min_tokens still to reach, a grammar, beams, and n > 1 samples still to
        fork from this one (the scheduler's fork groups, checked there), bad words of several tokens."""
        p = self.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                or self.num_output_tokens < p.min_tokens or self.structured_output is not None
                or self.beam is not None or any(len(s) > 1 for s in p.bad_words_token_ids))

    def sampling_row(self, drafts: list[int], generator: torch.Generator | None) -> SamplingRow:
        """The row that samples after `drafts` (taken as output: penalties, min_tokens), drawing from
        `generator`."""
        return SamplingRow(self.params, self.prompt_token_ids,
                           self.output_token_ids + drafts if drafts else self.output_token_ids, generator,
                           self.eos_token_ids)

    def drop_drafts(self) -> None:
        """Forget the drafts to verify, and the distributions they were drawn from."""
        self.spec_token_ids = []
        self.spec_draft_probs = None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first `num_output_tokens`, and every logprob recorded past them (with
        speculative decoding, logprobs come for every token the target emitted, also those a stop then dropped)."""
        for lp in self.logprobs[num_output_tokens:]:
            self.cumulative_logprob -= next(iter(lp.values())).logprob   # the first entry is the emitted token's
        del self.logprobs[num_output_tokens:]
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop checks after a token was appended; sets status and stop_reason."""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self.params.all_stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
