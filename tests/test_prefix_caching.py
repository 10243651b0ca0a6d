"""Prefix caching and shared blocks on the CPU without a model: exact block ids and free-list order."""
from hypothesis import given, settings, strategies as st

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.lora import LoRARequest
from kvserve.sampling_params import SamplingParams


def req(rid, tokens, max_tokens=8, **kw):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), {0}, **kw)


def run_prompt(kv, r):
    """Allocate and 'compute' the whole prompt of r, registering its full blocks."""
    hits, n = kv.get_computed_blocks(r)
    kv.allocate_slots(r, r.num_tokens - n, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)
    return [h.block_id for h in hits]


def test_miss_then_full_hit_then_partial_hit():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(13)))
    assert run_prompt(kv, a) == []                     # miss: blocks 0..3
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    b = req("b", list(range(13)))
    assert run_prompt(kv, b) == [0, 1, 2]              # full hit on the 3 full blocks, last token recomputed
    assert kv.get_block_ids("b") == [0, 1, 2, 4]
    c = req("c", list(range(6)) + [99] * 7)
    assert run_prompt(kv, c) == [0]                    # partial hit: diverges inside block 1
    assert kv.pool.blocks[0].ref_cnt == 3


def test_hit_on_a_freed_block_takes_it_off_the_free_list():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = req("a", list(range(9)))
    run_prompt(kv, a)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    b = req("b", list(range(9)))
    assert run_prompt(kv, b) == [0, 1]
    assert kv.pool.free_queue.block_ids() == [4, 5, 2]   # 0 and 1 touched, 3 taken for the tail


def test_eviction_is_lru_and_the_tail_goes_before_the_head():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4])
    run_prompt(kv, a)
    kv.free(a)                                           # free list: 2 3 | 1 0  (a's tail first)
    b = req("b", [5, 6, 7])
    run_prompt(kv, b)                                    # takes 2 and 3: a's blocks 0, 1 untouched
    assert kv.get_block_ids("b") == [2, 3]
    assert kv.pool.get_cached_block(a.block_hashes[0]) is kv.pool.blocks[0]
    c = req("c", [8])
    run_prompt(kv, c)                                    # now a's tail block (1) is evicted before its head (0)
    assert kv.get_block_ids("c") == [1]
    assert kv.pool.get_cached_block(a.block_hashes[1]) is None
    assert kv.pool.get_cached_block(a.block_hashes[0]) is kv.pool.blocks[0]


def test_salt_and_lora_keep_identical_prompts_apart():
    kv = KVCacheManager(num_blocks=24, block_size=4)
    run_prompt(kv, req("plain", list(range(9))))
    assert run_prompt(kv, req("salted", list(range(9)), cache_salt="tenant-a")) == []
    assert run_prompt(kv, req("salted2", list(range(9)), cache_salt="tenant-a")) != []
    assert run_prompt(kv, req("other", list(range(9)), cache_salt="tenant-b")) == []
    sql, chat = LoRARequest("sql", 1, "/adapters/sql"), LoRARequest("chat", 2, "/adapters/chat")
    assert run_prompt(kv, req("lora", list(range(9)), lora_request=sql)) == []
    assert run_prompt(kv, req("lora2", list(range(9)), lora_request=sql)) != []   # the same adapter shares
    assert run_prompt(kv, req("lora3", list(range(9)), lora_request=chat)) == []


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = req("a", list(range(9)))
    run_prompt(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert run_prompt(kv, req("b", list(range(9)))) == []


def test_copy_on_write_of_a_shared_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a, b = req("a", list(range(6))), req("b", list(range(6)))
    run_prompt(kv, a)                                    # blocks 0, 1 (block 1 holds 2 of 4 tokens)
    kv.fork(a, b)
    assert kv.get_block_ids("b") == [0, 1] and kv.pool.blocks[1].ref_cnt == 2
    b.num_computed_tokens = 5                            # b recomputes the last prompt token
    kv.allocate_slots(b, 1)
    assert kv.get_block_ids("b") == [0, 2]               # its write target was shared: copied into block 2
    assert kv.take_block_copies() == [(1, 2)]
    assert kv.pool.blocks[1].ref_cnt == 1 and kv.pool.blocks[0].ref_cnt == 2
    a.append_output_token(7)
    kv.allocate_slots(a, 1)                              # a is the only holder of block 1 now: no copy
    assert kv.get_block_ids("a") == [0, 1] and kv.take_block_copies() == []


def test_n_samples_share_the_prompt_blocks():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512)
    first = req("0_x", list(range(1, 42)), max_tokens=4)
    siblings = [req(f"{i}_x", list(range(1, 42)), max_tokens=4) for i in range(1, 8)]
    s.add_request(first, siblings)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("0_x", 41)]
    s.update_from_output(out, {"0_x": [5]})
    assert len(s.running) == 8
    used_after_prompt = 64 - kv.num_free_blocks
    assert used_after_prompt == 11                       # one copy of the 41-token prompt
    out = s.schedule()
    assert sorted(n for _, n in out.scheduled) == [1] * 8
    assert len(out.block_copies) == 7                    # each sibling copies the shared partial block once
    s.update_from_output(out, {r.request_id: [6] for r, _ in out.scheduled})
    assert 64 - kv.num_free_blocks == 11 + 7             # not 8 full copies (88 blocks)
    assert all(len(r.output_token_ids) == 1 for r in siblings)
    s.finish_requests([r.request_id for r in [first, *siblings]], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 64


def test_aborting_the_first_sample_before_its_prompt_runs_requeues_the_siblings():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(kv, 8, 64, 128)
    first, sib = req("0_y", [1, 2, 3]), req("1_y", [1, 2, 3])
    s.add_request(first, [sib])
    s.finish_requests("0_y", RequestStatus.FINISHED_ABORTED)
    assert list(s.waiting) == [sib]


def test_a_victim_preempted_after_its_copy_on_write_in_the_same_step_leaves_no_copy_behind():
    """Priority preemption can pick a request already scheduled in the step: its copy-on-write copy must go with it,
    or the freed copy block is handed to the next copy too (two copies into one block, either may win)."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    s = Scheduler(kv, 8, 8, 64, "priority")
    low = [req(f"{i}_low", list(range(1, 11)), priority=5, arrival_time=0.0) for i in range(2)]
    high = [req(f"{i}_high", list(range(20, 26)), priority=0, arrival_time=1.0) for i in range(2)]
    s.add_request(low[0], low[1:])
    s.update_from_output(s.schedule(), {})                     # 8 of low's 10 prompt tokens
    s.add_request(high[0], high[1:])
    out = s.schedule()                                           # the rest of low's prompt, all of high's
    s.update_from_output(out, {"0_low": [7], "0_high": [7]})         # both fork: the samples share partial blocks
    assert [r.request_id for r in s.running] == ["0_low", "0_high", "1_low", "1_high"] and kv.num_free_blocks == 1
    out = s.schedule()   # 0_low copies its shared block into the last free one; 0_high's copy preempts 0_low
    assert "0_low" in [r.request_id for r in out.preempted]
    check_block_copies(kv, out)
    [(src, dst)] = out.block_copies
    assert src == kv.get_block_ids("1_high")[-1] and dst == kv.get_block_ids("0_high")[-1]


def check_block_copies(kv, out):
    """A step's copy-on-write copies each go into a distinct block that a request scheduled in the step holds."""
    dsts = [dst for _, dst in out.block_copies]
    assert len(dsts) == len(set(dsts)), f"two copies into one block in a step: {out.block_copies}"
    held = {b.block_id for r, _ in out.scheduled for b in kv.req_to_blocks.get(r.request_id, ())}
    assert set(dsts) <= held, f"a copy into a block no scheduled request holds: {out.block_copies}"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 3), st.integers(1, 20),
                          st.integers(1, 4)), max_size=50),
       st.integers(8, 40), st.sampled_from(["fcfs", "priority"]), st.sampled_from([0.0, 2.0]))
def test_random_shared_prefix_workloads_never_leak_or_free_a_block_in_use(ops, budget, policy, aging):
    """n > 1 samples of shared prefixes under both policies: with priorities, victims may already be scheduled in
    the step that preempts them (their copy-on-write copies must go with them)."""
    num_blocks, bs = 16, 4
    kv = KVCacheManager(num_blocks, bs)
    s = Scheduler(kv, 6, budget, 64, policy, priority_aging_s=aging)
    prefixes = [list(range(10, 22)), list(range(30, 37)), [1, 2, 3, 4, 5, 6, 7, 8], [9]]
    parents = []
    for kind, which, length, n in ops:
        if kind == "add":
            tokens = prefixes[which] + list(range(100, 100 + length % 7))
            if -(-(len(tokens) + 6) // bs) > num_blocks:
                continue
            rid = f"p{len(parents)}"
            kids = [req(f"{i}_{rid}", tokens, max_tokens=6, priority=(length * 7) % 5, arrival_time=float(len(parents)))
                    for i in range(n)]
            s.add_request(kids[0], kids[1:])
            parents.append(kids)
        elif kind == "step":
            out = s.schedule()
            check_block_copies(kv, out)
            assert out.rejected == []
            s.update_from_output(out, {r.request_id: [50 + which] for r, k in out.scheduled
                                       if r.num_computed_tokens + k == r.num_tokens})
        elif parents:
            s.finish_requests([k.request_id for k in parents[length % len(parents)]], RequestStatus.FINISHED_ABORTED)
        holders = {}
        for rid, blocks in kv.req_to_blocks.items():
            assert len({b.block_id for b in blocks}) == len(blocks)
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in kv.pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), "ref count differs from the holders"
        assert sorted(kv.pool.free_queue.block_ids()) == [b.block_id for b in kv.pool.blocks if b.ref_cnt == 0]
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        check_block_copies(kv, out)
        s.update_from_output(out, {r.request_id: [3] for r, k in out.scheduled
                                   if r.num_computed_tokens + k == r.num_tokens})
    assert not s.has_unfinished_requests() and all(k.is_finished for kids in parents for k in kids)
    assert kv.num_free_blocks == num_blocks


def _trace(kv: KVCacheManager, workload, general_only: bool) -> list:
    """Run `workload` (prompts sharing prefixes, n samples, a small pool) through a scheduler; each step's scheduled
    tokens, block tables, copies and free blocks."""
    if general_only:
        kv._fits = lambda req, n: False
    s = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64)
    for i, (prompt, n, max_tokens) in enumerate(workload):
        group = [req(f"{j}_{i}", prompt, max_tokens=max_tokens) for j in range(n)]
        s.add_request(group[0], group[1:])
    trace = []
    while s.has_unfinished_requests():
        out = s.schedule()
        trace.append(([(r.request_id, n) for r, n in out.scheduled], sorted(out.block_copies), kv.num_free_blocks,
                      {r.request_id: kv.get_block_ids(r.request_id) for r, _ in out.scheduled}))
        s.update_from_output(out, {r.request_id: [7] for r, n in out.scheduled
                                   if r.num_computed_tokens + n >= r.num_tokens})
    return trace


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 13), st.integers(1, 3), st.integers(1, 9)),
                min_size=1, max_size=6),
       st.booleans())
def test_the_decode_fast_path_allocates_as_the_general_plan(prompts, caching):
    # prompts share one of three prefixes; the fast path (blocks already there, none shared) must change nothing:
    # not the tables, not the copies on write, not the free blocks, not the order of preemptions
    workload = [([prefix] * 5 + list(range(10, 10 + length)), n, max_tokens)
                for prefix, length, n, max_tokens in prompts]
    runs = [_trace(KVCacheManager(num_blocks=12, block_size=4, enable_caching=caching), workload, general)
            for general in (False, True)]
    assert runs[0] == runs[1]
