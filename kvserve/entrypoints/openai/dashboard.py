"""The live dashboard: GET /dashboard (one static page, no build step) and GET /dashboard/state (what it shows,
as JSON, taken on the engine thread between steps so every number comes from one moment).

    state = {"time", "model", "kv": {"num_blocks", "block_size", "cell_blocks", "cells": [...]},
             "requests": [...], "counts": {...}, "rates": {...}, "adapters": [...]}

A KV cell is one block, or on a large pool several (cell_blocks of them): -1 free, -2 free but still cached
(a prefix-cache hit can take it back), -3 the null block of sliding-window tables, i >= 0 held by requests[i] (the
request that holds most of the cell's blocks).
"""
from __future__ import annotations

import time
from collections import Counter
from importlib import resources

MAX_CELLS = 4096
STATE_MAX_AGE_S = 0.5   # polls (every open page, once a second) within this share one snapshot
FREE, CACHED, NULL = -1, -2, -3


def page() -> str:
    """The dashboard's HTML (kvserve/entrypoints/openai/dashboard.html)."""
    return resources.files("kvserve.entrypoints.openai").joinpath("dashboard.html").read_text()


def snapshot(engine, metrics, model_name: str) -> dict:
    """The dashboard's state of an LLMEngine (called on its thread) and its EngineMetrics."""
    scheduler, kv = engine.scheduler, engine.kv
    reqs = [(r, "running") for r in scheduler.running] + [
        (r, "preempted" if r.num_preemptions and not r.num_computed_tokens else "waiting") for r in scheduler.waiting]
    owner = {}
    requests = []
    for i, (req, state) in enumerate(reqs):
        blocks = [b for table in kv.get_group_block_ids(req.request_id) for b in table]
        for b in blocks:
            owner.setdefault(b, i)
        requests.append({"id": req.request_id, "state": state, "prompt_tokens": req.num_prompt_tokens,
                         "output_tokens": req.num_output_tokens, "max_tokens": req.max_tokens,
                         "computed_tokens": req.num_computed_tokens, "blocks": len(blocks),
                         "kind": "embedding" if req.pooling is not None else "beam" if req.beam else "generate"})
    stats = scheduler.stats()
    now = time.monotonic()
    spec = stats.spec_decoding
    return {
        "time": time.time(), "model": model_name,
        "kv": _cells(kv, owner),
        "requests": requests,
        "counts": {"running": stats.num_running, "waiting": stats.num_waiting,
                   "kv_usage": round(stats.kv_cache_usage, 4), "preemptions": stats.num_preemptions,
                   "prefix_cache_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 4)
                   if stats.prefix_cache_queries else None,
                   "spec_acceptance_rate": round(spec.num_accepted_tokens / spec.num_draft_tokens, 4)
                   if spec.num_draft_tokens else None,
                   "prompt_tokens": _total(metrics, "vllm:prompt_tokens_total"),
                   "generation_tokens": _total(metrics, "vllm:generation_tokens_total")},
        "rates": metrics.recent.summary(now),
        "adapters": sorted(engine.lora.registry) if engine.lora is not None else [],
    }


def _total(metrics, name: str) -> int:
    return int(metrics.registry.get_sample_value(name, {"model_name": metrics.model_name}) or 0)


def _cells(kv, owner: dict[int, int]) -> dict:
    pool = kv.pool
    states = []
    for block in pool.blocks:
        if block is pool.null_block:
            states.append(NULL)
        elif block.block_id in owner:
            states.append(owner[block.block_id])
        else:
            states.append(CACHED if block.block_hash is not None else FREE)
    per_cell = -(-len(states) // MAX_CELLS)
    cells = [Counter(states[i:i + per_cell]).most_common(1)[0][0] for i in range(0, len(states), per_cell)]
    return {"num_blocks": len(states), "block_size": kv.block_size, "cell_blocks": per_cell, "cells": cells,
            "used": sum(1 for s in states if s >= 0), "cached": states.count(CACHED), "free": states.count(FREE)}
