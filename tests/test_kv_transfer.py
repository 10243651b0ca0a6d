"""KV connectors (kvserve/kv_transfer): a producer engine saves its prompts' KV, a consumer engine loads it instead
of computing it. Outputs are identical to one engine alone, greedy and seeded, under batching, chunked prefill,
preemption and prefix caching, through shared storage and over TCP. The stores, the connector keys and the
manager's bookkeeping are tested without a model; bad configurations are refused."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.block_pool import BlockHash, hash_block_tokens
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.errors import InvalidRequestError, RequestFailedError
from kvserve.kv_transfer import KVTransferConfig, KVTransferError
from kvserve.kv_transfer import store as store_module
from kvserve.kv_transfer.connector import KVConnector
from kvserve.kv_transfer.keys import ConnectorHit, connector_keys
from kvserve.kv_transfer.store import FileStore

SHARED = "SharedStorageConnector"


def _config(role: str, path, connector: str = SHARED, **extra) -> dict:
    where = {"shared_storage_path": str(path)} if connector == SHARED else extra
    return {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": where}


# ----- configuration -----
@pytest.mark.parametrize("value, match", [
    ("{", "not valid JSON"), ([], "JSON object"), ({"kv_role": "kv_both"}, "needs kv_connector"),
    ({"kv_connector": "NixlConnector"}, "kv_connector must be one of"),
    ({"kv_connector": SHARED, "kv_role": "producer"}, "kv_role must be one of"),
    ({"kv_connector": SHARED, "kv_buffer_size": 0}, "kv_buffer_size"),
    ({"kv_connector": SHARED, "engine_id": "x"}, "unknown kv_transfer_config key"),
    ({"kv_connector": SHARED, "kv_connector_extra_config": {"port": 1}}, "unknown kv_connector_extra_config"),
    ({"kv_connector": "TcpConnector"}, "needs kv_connector_extra_config.port"),
    ({"kv_connector": "TcpConnector", "kv_connector_extra_config": {"port": 70000}}, "TCP port"),
])
def test_bad_configurations_are_refused(value, match):
    with pytest.raises(InvalidRequestError, match=match):
        KVTransferConfig.parse(value)


def test_what_the_connector_does_not_serve_is_refused(tmp_path, gguf_path):
    config = _config("kv_both", tmp_path)
    with pytest.raises(InvalidRequestError, match="enable_prefix_caching"):
        LLM(kv_transfer_config=config, enable_prefix_caching=False)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        LLM(kv_transfer_config=config, tensor_parallel_size=2)
    with pytest.raises(InvalidRequestError, match="LoRA"):
        LLM(kv_transfer_config=config, enable_lora=True)
    with pytest.raises(InvalidRequestError, match="calculate_kv_scales"):
        LLM(kv_transfer_config=config, kv_cache_dtype="fp8", calculate_kv_scales=True)
    from model_utils import save_tiny_model
    save_tiny_model("gemma3", tmp_path / "gemma3")
    with pytest.raises(InvalidRequestError, match="sliding-window"):
        LLM(model=str(tmp_path / "gemma3"), tokenizer=gguf_path, kv_transfer_config=config)


# ----- keys and stores -----
def _chain(tokens: list[list[int]], extra=()) -> list[BlockHash]:
    out, parent = [], None
    for block in tokens:
        parent = hash_block_tokens(parent, block, extra)
        out.append(parent)
    return out


def test_connector_keys_name_the_tokens_not_the_process():
    blocks = [[1, 2, 3, 4], [5, 6, 7, 8]]
    mine = _chain(blocks)
    # another process seeds its prefix-cache hashes differently: the same tokens, other hash values
    theirs = [BlockHash(bytes(32 - i) + b"\x01" * i, h.token_ids, h.extra_keys) for i, h in enumerate(mine)]
    root = b"r" * 32
    assert connector_keys(root, mine) == connector_keys(root, theirs)
    assert connector_keys(root, mine) != connector_keys(b"s" * 32, mine)   # another engine fingerprint
    assert connector_keys(root, mine)[1] != connector_keys(root, _chain([[1, 2, 3, 5], [5, 6, 7, 8]]))[1]
    assert connector_keys(root, mine) != connector_keys(root, _chain(blocks, (("salt", "x"),)))


def test_the_file_store_keeps_whole_blocks_and_evicts_the_least_recently_used(tmp_path, monkeypatch):
    store = FileStore(str(tmp_path), max_bytes=10 * 100, block_bytes=64)
    keys = [bytes([i]) * 32 for i in range(12)]
    for i, key in enumerate(keys[:3]):
        store.put(key, memoryview(bytes([i]) * 64))
    assert store.find_run(keys[:2] + keys[5:6] + keys[2:3]) == keys[:2]   # up to the first miss
    out = bytearray(2 * 64)
    store.read(store.find_run(keys[1:3]), memoryview(out))
    assert out == bytes([1]) * 64 + bytes([2]) * 64
    with open(store._path(keys[0]), "r+b") as f:   # a truncated file is a miss, and an error if read
        f.truncate(60)
    assert store.find_run(keys[:2]) == []
    with pytest.raises(KVTransferError, match="truncated"):
        store.read(keys[:1], memoryview(bytearray(64)))
    with pytest.raises(KVTransferError, match="could not be read"):
        store.read([keys[9]], memoryview(bytearray(64)))
    os.utime(store._path(keys[1]), (1, 1))   # the least recently used
    monkeypatch.setattr(store_module, "GRACE_S", 0.0)
    for i, key in enumerate(keys[3:], start=3):   # 12 blocks of 104 bytes in 1000: the oldest leave
        store.put(key, memoryview(bytes([i]) * 64))
    assert not store.contains(keys[1]) and store.contains(keys[11])
    monkeypatch.setattr(store_module, "GRACE_S", 3600.0)
    assert store.evict() == 0   # recently used blocks stay, even over the size


def _pools(num_blocks: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 255, (num_blocks, n), generator=g, dtype=torch.uint8) for n in (24, 40)]


def test_a_consumer_loads_the_bytes_a_producer_saved(tmp_path):
    producer_pools, consumer_pools = _pools(), [torch.zeros(8, 24, dtype=torch.uint8),
                                                torch.zeros(8, 40, dtype=torch.uint8)]
    producer = KVConnector(KVTransferConfig.parse(_config("kv_producer", tmp_path)), producer_pools, b"f")
    consumer = KVConnector(KVTransferConfig.parse(_config("kv_consumer", tmp_path)), consumer_pools, b"f")
    hashes = _chain([[1, 2], [3, 4], [5, 6]])
    assert producer.save(hashes[:2], [5, 2]) == 2 and producer.save(hashes[:2], [5, 2]) == 0   # once
    assert producer.lookup(hashes, 0) == []   # a producer loads nothing
    hits = consumer.lookup(hashes, 0)
    assert [h.block_hash for h in hits] == hashes[:2]
    consumer.load(list(zip(hits, [1, 7])))
    for mine, theirs in zip(consumer_pools, producer_pools):
        assert torch.equal(mine[1], theirs[5]) and torch.equal(mine[7], theirs[2])
    other = KVConnector(KVTransferConfig.parse(_config("kv_consumer", tmp_path)), consumer_pools, b"another model")
    assert other.lookup(hashes, 0) == []


# ----- the manager -----
class _Store:
    """A connector whose store holds the given hashes (the manager only asks lookup)."""

    def __init__(self, held: list[BlockHash]):
        self.held = held

    def lookup(self, hashes, start):
        return [ConnectorHit(h, b"k") for h in hashes[start:] if h in self.held][:len(hashes) - start]


def test_the_manager_continues_pool_hits_with_the_connector_and_drops_loads_into_freed_blocks():
    tokens = list(range(100, 117))   # 17 tokens, 4 full blocks of 4
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True)
    first = Request("a", tokens[:8] + [1], SamplingParams(max_tokens=1))   # shares 2 blocks
    kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_computed_blocks(first)
    kv.free(first)
    probe = Request("x", tokens, SamplingParams(max_tokens=1))
    kv.get_computed_blocks(probe)
    kv.connector = _Store(probe.block_hashes)
    req = Request("b", tokens, SamplingParams(max_tokens=1))
    hits, num = kv.get_computed_blocks(req)
    assert num == 16 and [type(h).__name__ for h in hits] == ["KVCacheBlock"] * 2 + ["ConnectorHit"] * 2
    kv.allocate_slots(req, 1, hits)
    loaded = kv.get_block_ids("b")[2:4]
    sharer = Request("c", tokens, SamplingParams(max_tokens=1))   # hits b's loaded blocks in the pool
    hits_c, num_c = kv.get_computed_blocks(sharer)
    assert num_c == 16 and all(type(h).__name__ == "KVCacheBlock" for h in hits_c)
    kv.allocate_slots(sharer, 1, hits_c)
    kv.free(req)   # c still reads the loaded blocks: their loads stay
    assert [block for _, block in kv.connector_loads] == loaded
    kv.free(sharer)   # nobody does: the loads go, and the blocks leave the prefix cache (never loaded)
    assert kv.take_connector_loads() == []
    assert all(kv.pool.blocks[b].block_hash is None for b in loaded)


# ----- engines -----
def _prompts(seed: int, lengths) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(100, 20000, (40,), generator=g).tolist()
    return [{"prompt_token_ids": shared + torch.randint(100, 20000, (n,), generator=g).tolist()} for n in lengths]


PROMPTS = _prompts(1, (30, 44, 38, 50))
PARAMS = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)] * 2


def _llm(**kwargs) -> LLM:
    """Small steps and a pool of 30 blocks of 4 tokens for four requests of ~70-90 tokens: chunked prefill and
    preemption storms."""
    return LLM(dtype="float32", block_size=4, max_num_batched_tokens=24, max_num_seqs=4, num_kv_blocks=30, **kwargs)


def _outputs(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def alone():
    """One engine's outputs (preempting too)."""
    llm = _llm()
    out = _outputs(llm)
    assert llm.llm_engine.scheduler.stats().num_preemptions > 0
    return out


def _prefill_then_decode(producer_config: dict, consumer_config: dict) -> tuple[list, LLM, LLM]:
    producer = _llm(kv_transfer_config=producer_config)
    _outputs(producer, params=SamplingParams(max_tokens=1))   # the proxy's prefill
    consumer = _llm(kv_transfer_config=consumer_config)
    return _outputs(consumer), producer, consumer


@pytest.mark.parametrize("transport", ["shared_storage", "tcp"])
def test_a_decode_engine_fed_by_a_prefill_engine_gives_one_engines_outputs(transport, alone, tmp_path):
    if transport == "tcp":
        from server_utils import free_port
        port = free_port()
        configs = [_config(role, None, "TcpConnector", port=port) for role in ("kv_producer", "kv_consumer")]
    else:
        configs = [_config(role, tmp_path) for role in ("kv_producer", "kv_consumer")]
    got, producer, consumer = _prefill_then_decode(*configs)
    assert got == alone
    saved, loaded = producer.llm_engine.runner.kv_connector.num_saved, consumer.llm_engine.runner.kv_connector
    # every full prompt block, the shared prefix's 10 once
    assert saved == sum(len(p["prompt_token_ids"]) // 4 for p in PROMPTS) - 3 * 10
    stats = consumer.llm_engine.scheduler.stats()
    assert stats.kv_transfer_loaded_blocks == loaded.num_loaded > 0 and stats.num_preemptions > 0
    producer.llm_engine.shutdown()   # a TCP producer's port is free again


def test_engines_whose_kv_bytes_differ_never_find_each_others_blocks(tmp_path):
    """The same model with another KV dtype or attention backend (another layout) computes other bytes."""
    config = _config("kv_both", tmp_path)
    _outputs(_llm(kv_transfer_config=config), params=SamplingParams(max_tokens=1))
    for other in (dict(kv_cache_dtype="fp8"), dict(attention_backend="torch")):
        consumer = _llm(kv_transfer_config=config, **other)
        _outputs(consumer, PROMPTS[:1], PARAMS[:1])
        assert consumer.llm_engine.runner.kv_connector.num_loaded == 0


def test_a_consumer_that_cannot_reach_its_producer_computes_the_prompts(alone, caplog):
    from server_utils import free_port
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        consumer = _llm(kv_transfer_config=_config("kv_consumer", None, "TcpConnector", port=free_port()))
        assert _outputs(consumer) == alone
    assert consumer.llm_engine.runner.kv_connector.num_loaded == 0
    assert "cannot be reached" in caplog.text


def test_engines_sharing_a_store_both_ways_and_a_producer_saving_its_cached_prefix(alone, tmp_path):
    """kv_both: the second engine loads what the first computed, and the first's second prompt, whose shared prefix
    hit its own pool, still saves that prefix (a consumer needs the whole run)."""
    config = _config("kv_both", tmp_path)
    first = _llm(kv_transfer_config=config)
    first.generate(PROMPTS[:2], SamplingParams(max_tokens=1), use_tqdm=False)
    second = _llm(kv_transfer_config=config)
    assert _outputs(second, PROMPTS[1:2], PARAMS[1:2]) == alone[1:2]
    assert second.llm_engine.runner.kv_connector.num_loaded == (40 + 44 - 1) // 4   # the last token computed


@pytest.mark.parametrize("error", [KVTransferError("the store lost them"), MemoryError("the store lost them")])
def test_a_failed_load_fails_its_step_and_leaves_no_block_behind(alone, tmp_path, monkeypatch, error):
    config = _config("kv_both", tmp_path)
    _outputs(_llm(kv_transfer_config=config), params=SamplingParams(max_tokens=1))
    consumer = _llm(kv_transfer_config=config)

    def lost(self, keys, out):
        raise error
    with monkeypatch.context() as m:
        m.setattr(FileStore, "read", lost)
        with pytest.raises(RequestFailedError, match="the store lost them"):
            consumer.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    pool = consumer.llm_engine.runner.kv.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.cached == {}   # the blocks never loaded left the cache
    assert _outputs(consumer, PROMPTS[:1], PARAMS[:1]) == alone[:1]   # the engine goes on, loading again


# ----- no block lost, leaked or loaded after free, across the pool, the host tier and the connector -----
from hypothesis import given, settings, strategies as st   # noqa: E402

from kvserve.core.host_tier import HostTier, TierHit   # noqa: E402


class _EveryBlockStore:
    """A connector whose store holds every block it is asked for (the manager's bookkeeping is what is tested)."""

    def lookup(self, hashes, start):
        return [ConnectorHit(h, b"k") for h in hashes[start:]]


def _check(kv: KVCacheManager) -> None:
    pool = kv.pool
    held = {}
    for rid in kv.req_to_blocks:
        for b in kv.get_block_ids(rid):
            held[b] = held.get(b, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == held.get(block.block_id, 0)   # no block leaked or freed twice
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    for block_hash, block in pool.cached.items():
        assert block.block_hash is not None and block.block_hash.value == block_hash
    loads = [b for _, b in kv.connector_loads] + [b for _, b in (kv.tier.loads if kv.tier else [])]
    assert all(pool.blocks[b].ref_cnt > 0 for b in loads)   # a queued load always has a holder


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "free", "copies"]), st.integers(0, 7),
                          st.integers(1, 40)), min_size=1, max_size=40), st.booleans(), st.booleans())
def test_blocks_stay_accounted_for_across_tiers(ops, with_tier, with_connector):
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, tier=HostTier(6) if with_tier else None,
                        connector=_EveryBlockStore() if with_connector else None)
    live: dict[str, Request] = {}
    for n, (op, which, length) in enumerate(ops):
        if op == "add":   # prompts over few token values: prefixes repeat
            req = Request(f"r{n}", [(which + i) % 3 for i in range(length)], SamplingParams(max_tokens=4))
            hits, num_hits = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, max(1, req.num_tokens - num_hits), hits) is not None:
                req.num_computed_tokens = num_hits
                live[req.request_id] = req
        elif op == "step" and live:   # the request computes what it holds room for
            req = sorted(live.values(), key=lambda r: r.request_id)[which % len(live)]
            req.num_computed_tokens = min(req.num_tokens, len(kv.get_block_ids(req.request_id)) * 4)
            kv.cache_computed_blocks(req)
        elif op == "free" and live:
            req = live.pop(sorted(live)[which % len(live)])
            kv.free(req)
        elif op == "copies":   # the runner takes the step's copies
            kv.take_tier_copies()
            kv.take_connector_loads()
        _check(kv)
