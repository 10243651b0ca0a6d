"""KV groups of sliding-window layers (kvserve/core/kv_groups.py): how layers are dealt into groups; under random
workloads (shared prefixes, n > 1, chunked prefill, preemption, aborts, prefix-cache hits) no block a layer still
reads is ever freed or handed to another request, none is leaked; a long Gemma 3 sequence holds a fraction of the
blocks full attention would."""
from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_groups import KVGroups, cdiv
from kvserve.core.request import RequestStatus
from kvserve.core.scheduler import Scheduler
from test_prefix_caching import req


def test_layers_are_dealt_into_equal_groups_full_ones_first():
    gemma3 = KVGroups.from_windows([512, 512, 512, 512, 512, None] * 3)
    assert (gemma3.num_groups, gemma3.group_size) == (6, 3) and gemma3.windows == (None,) + (512,) * 5
    assert [gemma3.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]   # the global layers share group 0
    places = sorted(zip(gemma3.layer_group, gemma3.layer_slot))   # each group one layer at each of its 3 places
    assert places == [(g, slot) for g in range(6) for slot in range(3)]
    gemma2 = KVGroups.from_windows([4096, None] * 13)
    assert gemma2.windows == (None, 4096) and gemma2.group_size == 13
    mistral = KVGroups.from_windows([4096] * 32)
    assert mistral.windows == (4096,) and mistral.group_size == 32
    assert KVGroups.from_windows([None] * 4) == KVGroups.single(4)
    assert gemma3.describe() == "6 groups of 3 layers: 1 full, 5 with a 512-token window"


def test_a_long_gemma3_sequence_holds_under_a_quarter_of_the_blocks_of_full_attention():
    """Gemma-3-270M's layers (3 global, 15 local with a 512-token window), a 16,000-token sequence computed in
    1,024-token chunks, then decoded: the pages held, each the size of 3 layers' blocks, against 18 layers'."""
    groups, bs = KVGroups.from_windows([512, 512, 512, 512, 512, None] * 3), 16
    kv = KVCacheManager(4000, bs, groups=groups)
    r = req("long", list(range(16000)), max_tokens=4)
    while r.num_computed_tokens < r.num_tokens:
        n = min(1024, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
    held = 4000 - 1 - kv.num_free_blocks
    full_attention = cdiv(16000, bs) * 18 / groups.group_size   # the same sequence in pages of 3 layers
    assert held / full_attention < 0.25, held / full_attention
    assert held <= kv.blocks_needed(16000, 1024)


def check_tables(kv: KVCacheManager, scheduled):
    """Every block a scheduled request reads or writes this step is a real one it holds; the ones it writes are
    its alone (copy-on-write done); ref counts equal the tables holding each block; the free list is the rest."""
    holders: dict[int, int] = {}
    for rid in kv.req_to_blocks:
        for table in kv._tables(rid):
            real = [b.block_id for b in table if b is not kv.null]
            assert len(set(real)) == len(real)
            for b in real:
                holders[b] = holders.get(b, 0) + 1
    for r, k in scheduled:
        for g, table in enumerate(kv._tables(r.request_id)):
            first = kv._first_needed(g, r.num_computed_tokens)
            end = cdiv(r.num_computed_tokens + k, kv.block_size)
            assert len(table) >= end
            assert all(table[i] is not kv.null for i in range(first, end)), "a block the step reads was dropped"
            assert all(table[i].ref_cnt == 1 for i in range(r.num_computed_tokens // kv.block_size, end))
    for b in kv.pool.blocks:
        if b is not kv.null:
            assert b.ref_cnt == holders.get(b.block_id, 0), "ref count differs from the holders"
    assert sorted(kv.pool.free_queue.block_ids()) == [b.block_id for b in kv.pool.blocks
                                                       if b.ref_cnt == 0 and b is not kv.null]


@settings(max_examples=int(os.environ.get("KVSERVE_HYPOTHESIS_EXAMPLES", 120)), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 3), st.integers(1, 30),
                          st.integers(1, 3)), max_size=50),
       st.integers(4, 24), st.sampled_from([[None, 6, 6], [5, 5], [None, 9, 3, None, 9, 3]]))
def test_random_workloads_never_drop_a_block_in_reach_or_leak(ops, budget, windows):
    num_blocks, bs = 40, 4
    kv = KVCacheManager(num_blocks, bs, groups=KVGroups.from_windows(windows))
    s = Scheduler(kv, 5, budget, 96)
    prefixes = [list(range(10, 30)), list(range(30, 37)), [1, 2, 3, 4, 5, 6, 7, 8], [9]]
    parents = []
    for kind, which, length, n in ops:
        if kind == "add":
            tokens = prefixes[which] + list(range(100, 100 + length))
            if kv.blocks_needed(len(tokens) + 6, budget) * n > kv.num_usable_blocks:
                continue
            rid = f"p{len(parents)}"
            kids = [req(f"{i}_{rid}", tokens, max_tokens=6) for i in range(n)]
            s.add_request(kids[0], kids[1:])
            parents.append(kids)
        elif kind == "step":
            out = s.schedule()
            assert out.rejected == []
            check_tables(kv, out.scheduled)
            s.update_from_output(out, {r.request_id: [50 + which] for r, k in out.scheduled
                                       if r.num_computed_tokens + k == r.num_tokens})
        elif parents:
            s.finish_requests([k.request_id for k in parents[length % len(parents)]], RequestStatus.FINISHED_ABORTED)
    for _ in range(600):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        check_tables(kv, out.scheduled)
        s.update_from_output(out, {r.request_id: [3] for r, k in out.scheduled
                                   if r.num_computed_tokens + k == r.num_tokens})
    assert not s.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks   # nothing leaked


def test_copy_on_write_copies_each_shared_pool_once(tmp_path):
    """Layers of different groups share pools: a batch of copies whose source is another copy's destination
    must read the block before it is overwritten, as one pass does, however many layers view the pool."""
    from types import SimpleNamespace

    import torch

    from kvserve.attention import attention_layers, bind_kv_cache, window_groups
    from kvserve.worker.model_runner import ModelRunner
    from model_utils import load_ours, save_tiny_model
    save_tiny_model("gemma3", tmp_path)
    model, _ = load_ours(str(tmp_path))
    groups = window_groups(model)
    assert groups.num_groups == 3 and groups.group_size == 1   # one pool pair, viewed by all 3 layers
    bind_kv_cache(model, 12, 4, torch.float32, groups=groups)
    pools = {a.k_cache.data_ptr(): a.k_cache for a in attention_layers(model)}
    assert len(pools) == 1
    for pool in pools.values():
        pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(pool.shape))
    before = {p: t.clone() for p, t in pools.items()}
    copies = [(2, 9), (4, 10), (6, 2), (8, 4)]   # block 2 is read, then written
    ModelRunner._copy_blocks(SimpleNamespace(models=[model], device="cpu"), copies)
    for p, pool in pools.items():
        want = before[p].clone()
        for src, dst in copies:
            want[dst] = before[p][src]
        assert torch.equal(pool, want)
