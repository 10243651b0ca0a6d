"""Per-request accounting (enable_request_accounting, --enable-request-accounting): what one request cost, for an
operator to bill or debug it. The engine adds to it every step; a request's output carries it in
metrics["accounting"], and the server in usage.kvserve_accounting.

    prompt_tokens_computed  prompt tokens the engine computed (again after a preemption)
    prompt_tokens_cached    prompt tokens served from the prefix cache when it was first scheduled
    kv_block_seconds        KV blocks held, integrated over time
    queue_seconds, prefill_seconds, decode_seconds   arrival -> first scheduled -> first token -> last token
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class RequestAccounting:
    prompt_tokens_computed: int = 0
    kv_block_seconds: float = 0.0


class Accountant:
    """Adds each step's work, and the blocks held while it ran, to the running requests' accounts (time between
    steps, when the engine is idle or waits for new requests, is nobody's)."""

    def __init__(self):
        self.start = time.monotonic()

    def begin(self) -> None:
        """Call as a step starts (before it schedules)."""
        self.start = time.monotonic()

    def step(self, scheduler, kv, scheduled) -> None:
        """Call after a step's forward, before its requests are updated (those that finish still count)."""
        elapsed = time.monotonic() - self.start
        for req in scheduler.running:
            if req.accounting is not None:
                held = sum(len(table) for table in kv.get_group_block_ids(req.request_id))
                req.accounting.kv_block_seconds += held * elapsed
        for req, n in scheduled:
            if req.accounting is not None:
                start = req.num_computed_tokens
                req.accounting.prompt_tokens_computed += max(0, min(start + n, req.num_prompt_tokens) - start)


def accounting_metrics(req) -> dict:
    """The finished account of a request, as its output's metrics["accounting"]."""
    a = req.accounting

    def span(start, end):
        return round(end - start, 6) if start is not None and end is not None else None
    return {"prompt_tokens_computed": a.prompt_tokens_computed,
            "prompt_tokens_cached": max(req.num_cached_tokens, 0),
            "kv_block_seconds": round(a.kv_block_seconds, 6),
            "queue_seconds": span(req.arrival_time, req.first_scheduled_time),
            "prefill_seconds": span(req.first_scheduled_time, req.first_token_time),
            "decode_seconds": span(req.first_token_time, req.last_token_time)}
