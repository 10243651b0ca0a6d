"""The prefix cache's host tier (kvserve/core/host_tier.py, kvserve/worker/kv_tier.py) and preemption by swap:
the tier keeps blocks the pool evicts and gives them back on a later hit (LRU, pinned while a step loads them);
through the engine, greedy and seeded outputs are identical with the tier and without it under preemption storms
and prefix caching, a prompt whose blocks left the pool and the tier is recomputed correctly, and what the tier
does not serve yet is refused with a clear error."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.block_pool import hash_block_tokens
from kvserve.core.host_tier import HostTier, TierHit
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.errors import InvalidRequestError


def _hashes(n: int, seed: int = 0):
    out, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, [seed, i, i + 1, i + 2])
        out.append(parent)
    return out


def test_the_tier_is_an_lru_whose_loading_slots_are_pinned():
    tier = HostTier(2)
    a, b, c = _hashes(3)
    tier.save(a, 10)
    tier.save(b, 11)
    assert tier.take_copies() == ([(10, 0), (11, 1)], [])
    assert tier.lookup(a) == TierHit(0, a)   # a is now the most recently used
    tier.save(c, 12)                         # evicts b
    assert tier.lookup(b) is None and tier.lookup(c) == TierHit(1, c)
    hit = tier.lookup(a)
    tier.pin([hit.slot])
    tier.load(hit, 5)
    tier.save(b, 13)   # the only unpinned slot is c's, whose own save of this step is dropped: one save a slot
    assert tier.lookup(c) is None and tier.lookup(a) is not None
    assert tier.take_copies() == ([(13, 1)], [(0, 5)])
    tier.save(hash_block_tokens(None, [9, 9, 9, 9]), 14)   # nothing pinned any more: the LRU entry goes
    assert tier.num_evicted == 3


def test_the_manager_saves_what_the_pool_evicts_and_loads_it_back():
    tier = HostTier(8)
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True, tier=tier)
    first = Request("a", list(range(100, 113)), SamplingParams(max_tokens=1))   # 13 tokens: 3 full blocks
    assert kv.allocate_slots(first, 13) is not None
    first_blocks = kv.get_block_ids("a")
    first.num_computed_tokens = 13
    kv.cache_computed_blocks(first)
    kv.free(first)
    other = Request("b", list(range(200, 216)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(other, 16) is not None   # the whole pool: first's blocks are evicted, and saved
    saves, loads = kv.take_tier_copies()
    slot_of = dict(saves)   # pool block -> slot
    assert sorted(slot_of) == sorted(first_blocks[:3]) and not loads
    kv.free(other)
    again = Request("c", list(range(100, 113)), SamplingParams(max_tokens=1))
    hits, num = kv.get_computed_blocks(again)
    assert num == 12 and all(isinstance(h, TierHit) for h in hits)
    assert [h.slot for h in hits] == [slot_of[b] for b in first_blocks[:3]]   # block i's bytes back as block i
    assert kv.allocate_slots(again, 1, hits) is not None
    saves, loads = kv.take_tier_copies()
    assert loads == list(zip([h.slot for h in hits], kv.get_block_ids("c")[:3]))
    # a request freed before its step ran takes its loads with it (the blocks may be handed out again)
    kv.free(again)
    kv.allocate_slots(Request("d", list(range(100, 113)), SamplingParams(max_tokens=1)), 1,
                      kv.get_computed_blocks(again)[0])
    kv.free(Request("d", [], SamplingParams(max_tokens=1)))
    assert kv.take_tier_copies()[1] == []


def test_the_tier_counters_reach_the_metrics():
    from kvserve.core.scheduler_stats import SchedulerStats
    from kvserve.metrics import EngineMetrics
    metrics = EngineMetrics("m")
    metrics.update_scheduler(SchedulerStats(0, 0, 0.0, 0, 0, 0, kv_tier_saved_blocks=7, kv_tier_loaded_blocks=3))
    metrics.update_scheduler(SchedulerStats(0, 0, 0.0, 0, 0, 0, kv_tier_saved_blocks=9, kv_tier_loaded_blocks=3))
    get = lambda name: metrics.registry.get_sample_value(name, {"model_name": "m"})   # noqa: E731
    assert (get("kvserve:kv_offload_saved_blocks_total"), get("kvserve:kv_offload_loaded_blocks_total")) == (9, 3)


def _prompts(seed: int, lengths) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(100, 20000, (40,), generator=g).tolist()
    return [{"prompt_token_ids": shared + torch.randint(100, 20000, (n,), generator=g).tolist()} for n in lengths]


def _run(prompts, **kwargs):
    llm = LLM(dtype="float32", block_size=4, max_num_batched_tokens=24, max_num_seqs=4, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)]
    outs = []
    for _ in range(2):   # the second time from cached blocks, in the pool or the tier
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts, params * (len(prompts) // 2), use_tqdm=False)]
    return outs, llm.llm_engine


PROMPTS = _prompts(0, (30, 44, 38, 50))


@pytest.fixture(scope="module")
def without_tier():
    """The outputs without a tier, and that engine (preempting too)."""
    return _run(PROMPTS, num_kv_blocks=30)


@pytest.mark.parametrize("kwargs", [dict(preemption_mode="swap", swap_space="8MiB"),
                                    dict(kv_offloading_size="2MiB")])
def test_outputs_are_identical_with_the_tier_under_preemption(kwargs, without_tier):
    """A pool of 30 blocks of 4 tokens for four requests of ~70-90 tokens: preemption storms; the second round
    finds prefixes in the pool and the tier; a small tier (2 MiB: 11 blocks of this model) also evicts its own."""
    want, plain = without_tier
    got, engine = _run(PROMPTS, num_kv_blocks=30, **kwargs)
    assert got == want
    tier = engine.runner.kv.tier
    assert engine.scheduler.stats().num_preemptions > 0 and plain.scheduler.stats().num_preemptions > 0
    assert tier.num_saved > 0 and tier.num_loaded > 0
    stats = engine.scheduler.stats()   # (what /metrics counts: kvserve:kv_offload_saved_blocks, _loaded_blocks)
    assert (stats.kv_tier_saved_blocks, stats.kv_tier_loaded_blocks) == (tier.num_saved, tier.num_loaded)
    if "kv_offloading_size" in kwargs:
        assert tier.num_evicted > 0   # the tier's own LRU turned over too, and what it lost was recomputed


def test_what_the_tier_does_not_serve_yet_is_refused(tmp_path, gguf_path):
    with pytest.raises(InvalidRequestError, match="enable_prefix_caching"):
        LLM(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(InvalidRequestError, match="preemption_mode"):
        LLM(preemption_mode="page-out")
    for bad in (-1, float("nan"), "inf", "lots"):
        with pytest.raises(InvalidRequestError, match="kv_offloading_size"):
            LLM(kv_offloading_size=bad)
    with pytest.raises(InvalidRequestError, match="hold no KV block"):
        LLM(kv_offloading_size="1KiB")
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        LLM(kv_offloading_size=1, tensor_parallel_size=2)
    from model_utils import save_tiny_model
    save_tiny_model("gemma3", tmp_path)
    with pytest.raises(InvalidRequestError, match="sliding-window"):
        LLM(model=str(tmp_path), tokenizer=gguf_path, preemption_mode="swap")


def test_a_copy_on_write_reads_its_source_before_a_load_lands_in_it(monkeypatch):
    """One schedule can plan a copy on write from block S, then free S (a preemption of the last other holder) and
    hand it to a tier hit as the block to load into: the copy must read S's old bytes first. The step's order is
    the tier's saves, the copies, the loads, then the forward."""
    import numpy as np

    from kvserve.core.scheduler import SchedulerOutput
    from kvserve.distributed.message import StepMessage
    from kvserve.worker.kv_tier import kv_pools
    from kvserve.worker.model_runner import StepInputs
    llm = LLM(dtype="float32", block_size=4, num_kv_blocks=8, kv_offloading_size="1MiB")
    runner = llm.llm_engine.runner
    src, dst, slot = 2, 5, 0
    pools = kv_pools(runner.models)
    for i, pool in enumerate(pools):
        pool[src], pool[dst] = 11 + i, 0
    for tier_slot in runner.tier_storage.slots:
        tier_slot[slot] = 99
    # what such a schedule queued: the load into S (the copy S -> D travels in the step's message)
    monkeypatch.setattr(runner.kv, "take_tier_copies", lambda: ([], [(slot, src)]))
    # the step: one token of a sequence in block 7 (its forward writes only there), the copy S -> D
    msg = StepMessage.build([1], [0], [1], [1], [[7]], [(src, dst)], [])
    runner._execute(SchedulerOutput(), StepInputs(msg, [], np.zeros(0, np.int64), []))
    for i, pool in enumerate(pools):
        assert (pool[dst] == 11 + i).all() and (pool[src] == 99).all()
