"""Scheduler on the CPU without a model: budgets, chunked prefill, preemption, priorities, LoRA slots, no leaks."""
from hypothesis import given, settings, strategies as st

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import LORA_MAX_WAIT_S, Scheduler
from kvserve.lora import LoRARequest
from kvserve.sampling_params import SamplingParams

EOS = 0


def make_sched(num_blocks=16, block_size=4, max_seqs=8, budget=32, policy="fcfs", caching=False, max_len=1000,
               aging=None):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, max_seqs, budget, max_len, policy, priority_aging_s=aging)


def make_req(rid, n_prompt, max_tokens=4, priority=0, t=None, first=1):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens), {EOS},
                   arrival_time=t, priority=priority)


def fake_step(s, token=7):
    """Run one step: every request that reached its end 'samples' `token`."""
    out = s.schedule()
    sampled = {r.request_id: [token] for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    s.update_from_output(out, sampled)
    return out


def scheduled(out):
    return [(r.request_id, n) for r, n in out.scheduled]


def test_prompts_are_admitted_within_the_token_budget_and_chunked():
    s = make_sched(budget=10)
    for rid, n in (("a", 6), ("b", 6)):
        s.add_request(make_req(rid, n))
    out = fake_step(s)
    assert scheduled(out) == [("a", 6), ("b", 4)]        # b gets the rest of the budget: a chunk
    assert s.requests["b"].num_computed_tokens == 4
    out = fake_step(s)
    assert scheduled(out) == [("a", 1), ("b", 2)]        # decodes first, then b's last chunk
    assert s.requests["a"].output_token_ids == [7, 7]
    assert s.requests["b"].output_token_ids == [7]


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    s = make_sched(budget=8, num_blocks=64)
    s.add_request(make_req("short", 2, max_tokens=10))
    fake_step(s)
    s.add_request(make_req("long", 40))
    steps = [scheduled(fake_step(s)) for _ in range(3)]
    assert steps == [[("short", 1), ("long", 7)]] * 3


def test_max_num_seqs_limits_the_running_set():
    s = make_sched(max_seqs=2)
    for rid in "abc":
        s.add_request(make_req(rid, 3))
    out = fake_step(s)
    assert [r for r, _ in scheduled(out)] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_frees_the_latest_request_and_requeues_it_first():
    s = make_sched(num_blocks=4, block_size=2, budget=16)
    s.add_request(make_req("a", 3, max_tokens=6))
    s.add_request(make_req("b", 3, max_tokens=6))
    fake_step(s)                       # a: blocks 0,1  b: blocks 2,3 (3 prompt tokens + room)
    fake_step(s)                       # the 4th token of each still fits
    assert s.kv.get_block_ids("a") == [0, 1] and s.kv.get_block_ids("b") == [2, 3]
    out = fake_step(s)                 # a needs a 3rd block for its 5th token: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert scheduled(out) == [("a", 1)]
    b = s.waiting[0]
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7]   # kept: it resumes by recomputing prompt + outputs
    assert s.kv.get_block_ids("a") == [0, 1, 3]   # b's tail block was freed first and is reused first
    assert s.num_preemptions == 1


def test_a_request_preempts_itself_when_it_is_the_only_victim():
    s = make_sched(num_blocks=2, block_size=2, budget=16)
    s.add_request(make_req("a", 3, max_tokens=4))
    fake_step(s)
    fake_step(s)
    out = fake_step(s)                  # a holds all blocks and needs a third
    assert [r.request_id for r in out.preempted] == ["a"] and out.scheduled == []


def test_priority_policy_admits_and_preempts_by_priority():
    s = make_sched(max_seqs=1, policy="priority")
    s.add_request(make_req("low", 2, priority=5, t=1.0))
    s.add_request(make_req("high", 2, priority=-1, t=2.0))
    s.add_request(make_req("mid", 2, priority=0, t=0.5))
    assert [r.request_id for r in s.waiting] == ["high", "mid", "low"]
    s2 = make_sched(num_blocks=4, block_size=2, budget=16, policy="priority")
    s2.add_request(make_req("x", 3, max_tokens=6, priority=0, t=1.0))
    s2.add_request(make_req("y", 3, max_tokens=6, priority=9, t=0.0))
    fake_step(s2)
    fake_step(s2)
    out = fake_step(s2)
    assert [r.request_id for r in out.preempted] == ["y"]   # y arrived first but has the lower priority


def test_a_waiting_request_preempts_running_ones_of_lower_priority():
    s = make_sched(max_seqs=1, policy="priority")
    s.add_request(make_req("low", 3, max_tokens=8, priority=5, t=0.0))
    fake_step(s)
    s.add_request(make_req("high", 3, max_tokens=2, priority=0, t=1.0))
    out = fake_step(s)
    assert [r.request_id for r in out.preempted] == ["low"] and scheduled(out) == [("high", 3)]
    assert [r.request_id for r in s.waiting] == ["low"]
    s.add_request(make_req("lower", 3, priority=9, t=2.0))   # ranks below the running request: just waits
    out = fake_step(s)
    assert out.preempted == [] and scheduled(out) == [("high", 1)]
    out = fake_step(s)
    assert scheduled(out) == [("low", 4)]   # recomputes its prompt and its one output token


def test_a_waiting_request_preempts_for_blocks_too():
    s = make_sched(num_blocks=4, block_size=2, max_seqs=4, policy="priority")
    s.add_request(make_req("low", 5, max_tokens=8, priority=5, t=0.0))
    s.add_request(make_req("low2", 1, max_tokens=8, priority=5, t=0.1))
    out = fake_step(s)
    assert scheduled(out) == [("low2", 1), ("low", 5)] and s.kv.num_free_blocks == 0
    s.add_request(make_req("high", 2, max_tokens=2, priority=0, t=1.0))
    out = fake_step(s)   # high needs one block: the later of the two equal-priority requests gives its block up
    assert [r.request_id for r in out.preempted] == ["low2"] and scheduled(out) == [("low", 1), ("high", 2)]


def test_a_request_that_can_never_fit_is_rejected_instead_of_blocking_the_queue():
    """The engine refuses such requests when they arrive; if one still reaches the queue, it must not stall it."""
    s = make_sched(num_blocks=4, block_size=4)
    s.add_request(make_req("huge", 20))       # 20 tokens, the pool holds 16
    s.add_request(make_req("small", 3))
    out = fake_step(s)
    assert [(r.request_id, error.message) for r, error in out.rejected] == [
        ("huge", "the request can never be scheduled: its 20 tokens need 5 KV blocks, but the whole KV cache has 4")]
    assert scheduled(out) == [("small", 3)] and not s.waiting
    s2 = make_sched(num_blocks=4, block_size=4)
    s2.add_request(make_req("a", 10, max_tokens=3))
    fake_step(s2)
    s2.add_request(make_req("b", 10))          # fits once "a" is done: waits, is not rejected
    out = fake_step(s2)
    assert out.rejected == [] and [r.request_id for r in s2.waiting] == ["b"]


def test_a_too_large_prompt_is_rejected_even_when_its_first_chunks_fit():
    """Chunked into a small budget, its first chunks fit the pool; it would preempt itself and start over forever."""
    s = make_sched(num_blocks=4, block_size=4, budget=8)
    s.add_request(make_req("huge", 20))
    s.add_request(make_req("small", 3))
    out = fake_step(s)
    assert [r.request_id for r, _ in out.rejected] == ["huge"] and scheduled(out) == [("small", 3)]


def test_without_chunked_prefill_a_prompt_over_the_step_budget_is_rejected():
    kv = KVCacheManager(64, 4, enable_caching=False)
    s = Scheduler(kv, 8, 8, 1000, "fcfs", enable_chunked_prefill=False)
    s.add_request(make_req("long", 12))
    s.add_request(make_req("short", 5))
    out = fake_step(s)
    assert [(r.request_id, error.message) for r, error in out.rejected] == [
        ("long", "the request can never be scheduled: its 12 tokens exceed max_num_batched_tokens=8 and chunked "
                 "prefill is off")]
    assert scheduled(out) == [("short", 5)]


def test_aging_orders_waiting_requests_by_priority_minus_time_waited():
    s = make_sched(max_seqs=1, policy="priority", aging=10.0)
    s.add_request(make_req("running", 2, max_tokens=50, priority=0, t=0.0))
    fake_step(s)
    s.add_request(make_req("old_low", 2, priority=3, t=0.0))     # rank 3 + 0/10 = 3
    s.add_request(make_req("new_high", 2, priority=0, t=25.0))   # rank 0 + 25/10 = 2.5
    s.add_request(make_req("newer_high", 2, priority=0, t=35.0))  # rank 3.5: waited 30 s less than old_low
    assert [r.request_id for r in s.waiting] == ["new_high", "old_low", "newer_high"]


def run_stream(aging, low_priority, dt, num_steps, low_max_tokens=2):
    """A low-priority request at t=0, then one priority-0 request per step (t = step * dt) that runs one step:
    the stream alone keeps the single sequence slot busy. Returns the step the low request finished in (None if it
    did not within num_steps) and every request added; the queue is drained before returning."""
    s = make_sched(num_blocks=64, max_seqs=1, policy="priority", aging=aging)
    low = make_req("low", 3, max_tokens=low_max_tokens, priority=low_priority, t=0.0)
    s.add_request(low)
    added, finished_at = [low], None
    for step in range(num_steps):
        added.append(make_req(f"h{step}", 2, max_tokens=1, priority=0, t=(step + 1) * dt))
        s.add_request(added[-1])
        fake_step(s)
        if low.is_finished and finished_at is None:
            finished_at = step
    for _ in range(4 * num_steps):
        if not s.has_unfinished_requests():
            break
        fake_step(s)
    assert all(r.is_finished for r in added) and s.kv.num_free_blocks == 64
    return finished_at, added


def test_without_aging_a_steady_stream_of_higher_priority_starves_a_request():
    assert run_stream(aging=0, low_priority=1, dt=1.0, num_steps=200)[0] is None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10), st.floats(0.5, 30.0), st.floats(0.1, 5.0), st.integers(1, 4))
def test_with_aging_every_request_finishes_while_higher_priority_ones_keep_coming(low_priority, aging, dt,
                                                                                  low_max_tokens):
    # past low_priority * aging seconds every new arrival ranks below it; the ones before are served one a step
    bound = int(low_priority * aging / dt) + low_max_tokens + 3
    finished_at, added = run_stream(aging, low_priority, dt, bound + 50, low_max_tokens)
    assert finished_at is not None and finished_at <= bound
    assert all(r.output_token_ids for r in added)   # each one generated its tokens


def test_finish_on_eos_and_on_max_tokens_frees_blocks():
    s = make_sched()
    s.add_request(make_req("a", 3, max_tokens=2))
    s.add_request(make_req("b", 3, max_tokens=5))
    fake_step(s)
    fake_step(s, token=EOS)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 16


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make_sched(max_seqs=1)
    s.add_request(make_req("a", 5))
    s.add_request(make_req("b", 5))
    fake_step(s)
    done = s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"a", "b"}
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished_requests()


def _check_invariants(s: Scheduler, num_blocks: int):
    owners = {}
    for rid, blocks in s.kv.req_to_blocks.items():
        for b in blocks:
            owners.setdefault(b.block_id, []).append(rid)
    for bid, rids in owners.items():
        assert len(rids) == len(set(rids)), f"block {bid} owned twice by one request"
        assert s.kv.pool.blocks[bid].ref_cnt == len(rids), f"block {bid} ref count wrong"
    free = s.kv.pool.free_queue.block_ids()
    assert len(free) == len(set(free)) and not set(free) & set(owners)
    assert len(free) + len(owners) == num_blocks, "a block leaked"
    for r in s.running:
        assert r.status == RequestStatus.RUNNING


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.booleans(), st.sampled_from(["fcfs", "priority"]), st.integers(4, 32))
def test_random_add_step_abort_never_leaks_or_double_owns(ops, caching, policy, budget):
    num_blocks, block_size = 12, 4
    s = make_sched(num_blocks=num_blocks, block_size=block_size, max_seqs=4, budget=budget, policy=policy,
                   caching=caching)
    added = []
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, first = op
            if -(-(n + max_tokens) // block_size) > num_blocks:
                continue   # the engine rejects these at add time
            rid = f"r{len(added)}"
            s.add_request(make_req(rid, n, max_tokens, priority=first, first=first))
            added.append(s.requests[rid])
        elif op[0] == "step":
            for _ in range(op[1]):
                fake_step(s, token=5)
        elif added:
            s.finish_requests(added[op[1] % len(added)].request_id, RequestStatus.FINISHED_ABORTED)
        _check_invariants(s, num_blocks)
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        fake_step(s, token=5)
    assert not s.has_unfinished_requests(), "a request never finished"
    assert all(r.is_finished for r in added)
    assert s.kv.num_free_blocks == num_blocks and not s.kv.req_to_blocks


def test_scheduler_holds_requests_past_max_loras_and_lets_others_by():
    loading = {3}
    sched = Scheduler(KVCacheManager(64, 4), 8, 64, 64, max_loras=2,
                      lora_ready=lambda r: r.lora_id not in loading)
    a, b, c, d = (LoRARequest(n, i, f"/{n}") for i, n in enumerate("abcd", 1))
    reqs = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=4), lora_request=lr)
            for i, lr in enumerate([a, b, c, a, None, d])]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    # a, b fill both slots; c and d wait for a slot; a's second request and the base one go
    assert [r.request_id for r, _ in out.scheduled] == ["0", "1", "3", "4"]
    assert [r.request_id for r in sched.waiting] == ["2", "5"]
    stats = sched.stats()
    assert stats.running_lora_ids == {1, 2} and stats.waiting_lora_ids == {3, 4}
    for r in list(sched.running):
        if r.lora_id == 2:
            sched.finish_requests(r.request_id, r.status.FINISHED_STOPPED)
    sched.schedule()   # b's slot is free: c's adapter loads into it, so d (ready) still waits
    assert [r.request_id for r in sched.running] == ["0", "3", "4"]
    assert [r.request_id for r in sched.waiting] == ["2", "5"]
    loading.clear()
    sched.schedule()
    assert [r.request_id for r in sched.running] == ["0", "3", "4", "2"]
    for r in list(sched.running):
        if r.lora_id == 1:
            sched.finish_requests(r.request_id, r.status.FINISHED_STOPPED)
    sched.schedule()
    assert [r.request_id for r in sched.running] == ["4", "2", "5"] and not sched.waiting


def test_a_request_held_for_a_slot_cannot_starve():
    """Requests of the running adapter keep arriving; once the one waiting for a slot has waited
    LORA_MAX_WAIT_S, the requests behind it wait too, the running adapter drains and it starts."""
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    sched = Scheduler(KVCacheManager(64, 4), 8, 64, 64, max_loras=1, lora_ready=lambda r: True)
    req = lambda rid, lr: Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), lora_request=lr)
    sched.add_request(req("a0", a))
    sched.schedule()
    waiting_b = req("b0", b)
    sched.add_request(waiting_b)
    sched.add_request(req("a1", a))
    sched.schedule()   # b0 waits for the slot; a1, behind it, uses the running adapter and starts
    assert [r.request_id for r in sched.running] == ["a0", "a1"]
    waiting_b.lora_wait_start -= LORA_MAX_WAIT_S
    sched.add_request(req("a2", a))
    sched.add_request(req(None or "base", None))
    sched.schedule()   # b0 has waited long enough: nothing starts behind it
    assert [r.request_id for r in sched.waiting] == ["b0", "a2", "base"]
    for rid in ("a0", "a1"):
        sched.finish_requests(rid, waiting_b.status.FINISHED_STOPPED)
    sched.schedule()
    assert [r.request_id for r in sched.running] == ["b0", "base"] and [r.request_id for r in sched.waiting] == ["a2"]
    assert waiting_b.lora_wait_start is None   # started: a later wait (after a preemption) counts from zero


def _token(rid: str, position: int) -> int:
    """A model stand-in: the token each request samples at each position, the same however it is scheduled
    (EOS at about one position in nine)."""
    import zlib
    return zlib.crc32(f"{rid}:{position}".encode()) % 9   # 0 is EOS


def _run(s: Scheduler, reqs: list[Request], pipelined: bool) -> None:
    """Every request to its end, each step sampling _token at the position it computes. pipelined: async
    scheduling's order (the next step scheduled and committed before the last one's tokens are merged)."""
    for r in reqs:
        s.add_request(r)
    pending = None
    for _ in range(2000):
        if not s.has_unfinished_requests() and pending is None:
            return
        out = s.schedule()
        s.finish_requests([r.request_id for r, _ in out.rejected], RequestStatus.FINISHED_ABORTED)   # as the engine
        launched = None
        if not out.is_empty:
            ends = [(r, r.num_computed_tokens + n) for r, n in out.scheduled
                    if r.num_computed_tokens + n == r.num_tokens + r.num_placeholders]
            sampling = [r for r, _ in ends]
            tokens = {r.request_id: [_token(r.request_id, end)] for r, end in ends}
            if pipelined:
                s.commit(out, sampling)
                launched = (out, tokens)
            else:
                s.update_from_output(out, tokens)
        if pending is not None:
            s.update_from_output(*pending, committed=True)
        pending = launched
    raise AssertionError("the requests did not finish")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=6),
       st.integers(6, 24), st.sampled_from([2, 4]), st.integers(3, 16), st.integers(1, 4), st.booleans())
def test_async_scheduling_ends_every_request_as_the_synchronous_order_does(specs, num_blocks, block_size, budget,
                                                                          max_seqs, caching):
    """The pipelined order (a step's tokens merged after the next step is committed: placeholders, tokens known
    one step late, EOS found after one more token was computed, preemption and max_tokens with a token in flight)
    gives every request the tokens and the finish the synchronous order does, and leaks no block."""
    results = []
    for pipelined in (False, True):
        s = make_sched(num_blocks=num_blocks, block_size=block_size, max_seqs=max_seqs, budget=budget,
                       caching=caching)
        reqs = [make_req(f"r{i}", n, max_tokens=m, first=1 + 5 * i) for i, (n, m) in enumerate(specs)]
        free = s.kv.num_free_blocks
        _run(s, reqs, pipelined)
        assert s.kv.num_free_blocks == free
        assert all(r.num_placeholders == 0 and r.is_finished for r in reqs)
        results.append([(r.output_token_ids, r.status) for r in reqs])
    assert results[0] == results[1]
