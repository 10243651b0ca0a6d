"""BlockPool and KVCacheManager on the CPU without a model: exact block ids and free-list order."""
import pytest

from kvserve.core.block_pool import BlockPool, hash_block_tokens
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams


def make_req(rid, tokens, **kw):
    return Request(rid, tokens, SamplingParams(max_tokens=kw.pop("max_tokens", 8)), **kw)


def test_new_blocks_come_from_the_free_list_head_in_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 4]
    assert pool.free_queue.block_ids() == [5]
    assert pool.num_free_blocks == 1


def test_freed_blocks_join_the_tail_and_are_reused_last():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.free_blocks(reversed(a))
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 1]


def test_asking_for_too_many_blocks_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)


def test_double_free_is_detected():
    pool = BlockPool(2)
    [b] = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([b])


def test_touch_takes_a_free_block_off_the_list_in_place():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)
    pool.touch([blocks[2]])
    assert pool.free_queue.block_ids() == [0, 1, 3]
    assert blocks[2].ref_cnt == 1


def test_allocate_slots_grows_only_when_the_tail_block_is_full():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    req = make_req("a", list(range(6)))
    assert [b.block_id for b in kv.allocate_slots(req, 6)] == [0, 1]
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) == []          # tokens 6, 7 fit in block 1
    req.num_computed_tokens = 8
    assert [b.block_id for b in kv.allocate_slots(req, 1)] == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_allocate_slots_returns_none_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=False)
    req = make_req("a", list(range(9)))
    assert kv.allocate_slots(req, 9) is None
    assert kv.num_free_blocks == 2
    assert kv.get_block_ids("a") == []


def test_free_puts_the_tail_first_on_the_free_list():
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_caching=False)
    req = make_req("a", list(range(6)))
    kv.allocate_slots(req, 6)
    kv.free(req)
    assert kv.pool.free_queue.block_ids() == [3, 4, 2, 1, 0]


def test_block_hashes_chain_and_carry_extra_keys():
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    assert hash_block_tokens(None, [1, 2]) == h0
    assert hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4]).value != h1.value
    assert hash_block_tokens(None, [1, 2], (("salt", "x"),)).value != h0.value


def test_prefix_hit_after_the_first_request_finished():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(10)))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    kv.free(a)
    b = make_req("b", list(range(9)) + [99])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    new = kv.allocate_slots(b, 2, hits)
    assert kv.get_block_ids("b")[:2] == [0, 1] and len(new) == 1


def test_the_last_token_is_never_a_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    hits, n = kv.get_computed_blocks(make_req("b", list(range(8))))
    assert n == 4 and len(hits) == 1   # block 1 would leave nothing to compute


def test_a_forged_hash_collision_is_refused_by_the_token_check():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.cache_computed_blocks(a)
    b = make_req("b", [7, 8, 3])
    kv._update_block_hashes(b, 3)
    forged = type(b.block_hashes[0])(a.block_hashes[0].value, b.block_hashes[0].token_ids)
    b.block_hashes[0] = forged          # same hash value as a's block, different tokens
    assert kv.pool.cached.get(forged.value) is not None
    assert kv.get_computed_blocks(b) == ([], 0)
