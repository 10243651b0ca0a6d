"""Draft tokens in the scheduler and the KV cache manager, without a model: the budget, the rollback of rejected
drafts, and that their blocks never reach the prefix cache and never leak."""
from hypothesis import given, settings, strategies as st

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams


def req(rid, tokens, max_tokens=20, **kw):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), {0}, **kw)


def decoding(s, r, first_token=7):
    """Run r's prompt and sample its first token."""
    out = s.schedule()
    s.update_from_output(out, {r.request_id: [first_token]})


def test_drafts_are_scheduled_with_the_last_token_and_rejected_ones_roll_back():
    kv = KVCacheManager(8, 4)
    s = Scheduler(kv, 4, 64, 64)
    r = req("r", [1, 2, 3, 4, 5, 6])
    s.add_request(r)
    decoding(s, r)                                  # tokens 1..6, 7; computed 6
    r.spec_token_ids = [8, 9, 10, 11]
    out = s.schedule()
    assert out.scheduled == [(r, 5)] and out.num_batched_tokens == 5
    assert len(kv.req_to_blocks["r"]) == 3          # positions 0..10
    s.update_from_output(out, {"r": [8, 9, 20]})    # two drafts accepted, the third rejected: 20 instead of 10
    assert r.output_token_ids == [7, 8, 9, 20] and r.spec_token_ids == []
    assert r.num_computed_tokens == 9               # KV of 1..6, 7, 8, 9; position 9 held the rejected draft
    assert kv.num_cached_blocks["r"] == 2           # blocks 0 and 1 hold 1..8, all verified
    hashes = [b.block_hash.token_ids for b in kv.req_to_blocks["r"][:2]]
    assert hashes == [(1, 2, 3, 4), (5, 6, 7, 8)]
    r.spec_token_ids = [21]
    out = s.schedule()
    assert out.scheduled == [(r, 2)]                # 20 (recomputed over the rejected draft's KV) and 21
    s.update_from_output(out, {"r": [21, 22]})      # all accepted, plus the bonus token
    assert r.num_computed_tokens == 11 and r.output_token_ids == [7, 8, 9, 20, 21, 22]
    assert kv.num_cached_blocks["r"] == 2           # block 2 waits for the KV of 22


def test_the_budget_trims_drafts_and_a_full_pool_drops_them_before_preempting():
    kv = KVCacheManager(5, 4)
    s = Scheduler(kv, 4, 3, 64)
    a = req("a", [1, 2, 3])
    s.add_request(a)
    decoding(s, a)                                  # a: 4 tokens, computed 3
    a.spec_token_ids = [5, 6, 7, 8]
    out = s.schedule()
    assert out.scheduled == [(a, 3)] and a.spec_token_ids == [5, 6]   # the budget of 3 leaves two drafts
    s.update_from_output(out, {"a": [5, 6, 9]})
    s.max_num_batched_tokens = 64
    b = req("b", [1] * 8)
    s.add_request(b)
    out = s.schedule()
    s.update_from_output(out, {"a": [11], "b": [1]})   # a and b hold 2 blocks each: 1 free
    a.spec_token_ids = list(range(10, 20))          # a would need 3 more blocks for these
    out = s.schedule()
    assert a.spec_token_ids == [] and (a, 1) in out.scheduled and out.preempted == []


def test_drafts_of_requests_already_scheduled_are_dropped_before_anyone_is_preempted():
    kv = KVCacheManager(5, 4)
    s = Scheduler(kv, 4, 64, 64)
    a, b = req("a", [1, 2, 3]), req("b", [4, 5, 6, 7, 8, 9, 10, 11])
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": [11], "b": [12]})   # a: 1 block, b: 2 blocks; 2 free
    a.spec_token_ids = [13, 14, 15, 16, 17, 18]                 # a takes both free blocks for these
    out = s.schedule()                                           # b then needs a third block
    assert out.preempted == [] and a.spec_token_ids == []
    assert out.scheduled == [(a, 1), (b, 1)] and len(kv.req_to_blocks["a"]) == 1
    s.update_from_output(out, {"a": [13], "b": [14]})
    assert kv.num_free_blocks == 1


def write_kv(kv, out, content):
    """What the forward pass writes: each scheduled token (drafts included) into its slot; content[block] is the
    tokens whose KV the block holds."""
    bs = kv.block_size
    for r, n in out.scheduled:
        start = r.num_computed_tokens
        for pos, token in enumerate((r.all_token_ids + r.spec_token_ids)[start:start + n], start):
            block = kv.req_to_blocks[r.request_id][pos // bs]
            content.setdefault(block.block_id, [None] * bs)[pos % bs] = token


def verified_blocks_only(kv, reqs, content):
    """Every block in the prefix cache holds the KV of exactly the tokens its hash names, and a request's
    registered blocks are its verified tokens."""
    bs = kv.block_size
    for block in kv.pool.cached.values():
        assert tuple(content[block.block_id]) == block.block_hash.token_ids
    for r in reqs:
        n = kv.num_cached_blocks.get(r.request_id, 0)
        assert n * bs <= r.num_computed_tokens <= r.num_tokens
        for i, block in enumerate(kv.req_to_blocks.get(r.request_id, [])[:n]):
            assert block.block_hash.token_ids == tuple(r.all_token_ids[i * bs:(i + 1) * bs])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "propose", "step", "propose", "abort"]), st.integers(0, 2),
                          st.integers(0, 5), st.integers(1, 6)), min_size=10, max_size=80),
       st.integers(4, 30))
def test_random_drafts_never_reach_the_prefix_cache_and_never_leak(ops, budget):
    num_blocks, bs = 12, 4
    kv = KVCacheManager(num_blocks, bs)
    s = Scheduler(kv, 4, budget, 64)
    prefixes = [list(range(10, 19)), list(range(30, 35)), [1, 2, 3]]
    reqs, content = [], {}
    for kind, which, x, y in ops:
        if kind == "add":
            tokens = prefixes[which] + list(range(100, 100 + x % 5))
            r = req(f"r{len(reqs)}", tokens, max_tokens=10)
            if -(-(len(tokens) + 10) // bs) <= num_blocks:
                s.add_request(r)
                reqs.append(r)
        elif kind == "propose":
            for r in s.running:
                if r.num_computed_tokens == r.num_tokens - 1:
                    limit = r.max_tokens - r.num_output_tokens - 1
                    r.spec_token_ids = [900 + (x + j) % 3 for j in range(min(y, limit))]
        elif kind == "step":
            out = s.schedule()
            write_kv(kv, out, content)
            sampled = {}
            for r, n in out.scheduled:
                drafts = r.spec_token_ids
                if r.num_computed_tokens + n == r.num_tokens + len(drafts):
                    m = min(x, len(drafts))   # accept m drafts, then a token no draft is
                    sampled[r.request_id] = drafts[:m] + [500 + y]
            s.update_from_output(out, sampled)
        elif reqs:
            s.finish_requests(reqs[x % len(reqs)].request_id, RequestStatus.FINISHED_ABORTED)
        verified_blocks_only(kv, s.running, content)
        holders = {}
        for blocks in kv.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert all(b.ref_cnt == holders.get(b.block_id, 0) for b in kv.pool.blocks)
    for _ in range(300):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.update_from_output(out, {r.request_id: [3] for r, n in out.scheduled
                                   if r.num_computed_tokens + n == r.num_tokens})
    assert not s.has_unfinished_requests()
    assert kv.num_free_blocks == num_blocks
