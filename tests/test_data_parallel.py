"""Data-parallel replicas on Ray behind one OpenAI server (kvserve/distributed/dp_engine.py): the router, the merged
metrics, and two replicas of the bundled model on a local Ray instance (outputs, prefix routing, a killed replica)."""
from __future__ import annotations

import asyncio
import functools

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.scheduler_stats import SchedulerStats
from kvserve.distributed.metrics import merge_replica_metrics
from kvserve.distributed.router import PrefixRouter
from kvserve.metrics import EngineMetrics


def test_router_prefers_the_cached_prefix_then_the_least_loaded():
    router = PrefixRouter(3, block_size=4, blocks_per_replica=3)
    a, b = list(range(10, 23)), list(range(50, 63))   # 13 tokens: 3 full blocks before the last token
    assert len(router.block_hashes(a)) == 3 and len(router.block_hashes(a[:12])) == 2
    assert router.block_hashes(a, "salt") != router.block_hashes(a)   # a salted prompt shares no blocks
    router.started(0, router.block_hashes(b))
    router.started(1, [])
    first = router.choose(router.block_hashes(a))
    assert first == 2   # no replica holds a's prefix: the least loaded one
    router.started(2, router.block_hashes(a))
    router.started(2, [])
    router.started(2, [])
    assert router.choose(router.block_hashes(a[:9] + [99] * 4)) == 2   # two cached blocks beat the load
    assert router.cached_prefix(2, router.block_hashes(a[:9] + [99] * 4)) == 2
    router.finished(1)
    assert router.choose(router.block_hashes([1] * 13)) == 1
    router.started(2, router.block_hashes([7] * 13))   # the view holds as many blocks as the replica: a's go first
    assert router.cached_prefix(2, router.block_hashes(a)) == 0
    router.remove(2)
    assert router.choose(router.block_hashes([7] * 13)) in (0, 1)
    router.remove(0), router.remove(1)
    with pytest.raises(ValueError):
        router.choose([])


def test_metrics_are_labelled_per_replica_with_totals():
    texts = {}
    for replica, running in ((0, 3), (2, 4)):
        m = EngineMetrics("m")
        m.update_scheduler(SchedulerStats(num_running=running, num_waiting=1, kv_cache_usage=0.5, num_preemptions=0,
                                          prefix_cache_queries=10 * running, prefix_cache_hits=running))
        texts[replica] = m.render()
    text = merge_replica_metrics(texts).decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in text
    assert 'vllm:num_requests_running{engine="2",model_name="m"} 4.0' in text
    assert 'vllm:num_requests_running{engine="total",model_name="m"} 7.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="total",model_name="m"} 0.5' in text   # a fraction: the mean
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1


ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False)
    yield
    ray.shutdown()


PREFIX = ("You are a helpful assistant for a small bakery. You answer questions about bread, cakes and opening "
          "hours politely and briefly, and you never invent prices. ")


def test_two_replicas_serve_route_and_survive_a_kill(local_ray):
    from kvserve.distributed.dp_engine import DataParallelEngine
    from kvserve.entrypoints.openai.api_server import ServerSettings, build_app
    config = EngineConfig(dtype="float32", distributed_executor_backend="ray", kv_cache_memory="64MiB")
    prompts = [f"Question {i}: name a kind of {w}." for i, w in enumerate(["bread", "cake", "fruit", "tree"])]
    one = LLM(dtype="float32", kv_cache_memory="64MiB")
    want = [o.outputs[0].text for o in one.generate(prompts + [PREFIX + "When do you open?"],
                                                    SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)]
    engine = DataParallelEngine(config, 2, "m")
    app = build_app(engine, ServerSettings(served_model_names=["m"]))

    async def complete(http, prompt, max_tokens=12):
        return await http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0})

    def value(name, text, replica):
        line = next(x for x in text.splitlines() if x.startswith(name) and f'engine="{replica}"' in x)
        return float(line.rsplit(" ", 1)[1])
    hits = functools.partial(value, "vllm:prefix_cache_hits_total")
    running = functools.partial(value, "vllm:num_requests_running")

    async def scenario(http):
        got = await asyncio.gather(*(complete(http, p) for p in prompts))
        assert [r.json()["choices"][0]["text"] for r in got] == want[:4]
        # replica 0 busy with a long request: the first prefixed prompt goes to replica 1 (least loaded)...
        busy = asyncio.ensure_future(complete(http, "Tell me a long story about bread.", 48))
        while not engine.router.load[0]:
            await asyncio.sleep(0.01)
        first = await complete(http, PREFIX + "When do you open?")
        assert first.json()["choices"][0]["text"] == want[4]
        await busy
        # ...and the second one follows its cached prefix there, though both replicas are idle now
        before = hits((await http.get("/metrics")).text, 1)
        assert (await complete(http, PREFIX + "Do you sell rye bread?")).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert hits(metrics, 1) - before >= len(PREFIX) // 8 // 16 and hits(metrics, 0) == 0
        assert 'engine="total"' in metrics
        # a replica killed while it serves a request: that request fails, the server goes on with the other
        pending = [asyncio.ensure_future(complete(http, f"Count to {n}.", 64)) for n in (20, 30)]
        while running((await http.get("/metrics")).text, 1) < 1:   # replica 1 has taken its request
            await asyncio.sleep(0.02)
        ray.kill(engine.replicas[1])
        results = await asyncio.gather(*pending)
        assert sorted(r.status_code for r in results) == [200, 500]
        failed = next(r for r in results if r.status_code == 500)
        assert "replica 1 died" in failed.json()["error"]["message"]
        again = await asyncio.gather(*(complete(http, p) for p in prompts[:2]))
        assert [r.json()["choices"][0]["text"] for r in again] == want[:2]
        assert (await http.get("/health")).status_code == 200
        assert 'engine="1"' not in (await http.get("/metrics")).text

    async def main():
        engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m",
                                         timeout=120) as http:
                await scenario(http)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_tensor_parallel_ranks_as_ray_actors(local_ray, tmp_path):
    """distributed_executor_backend="ray": rank 1 is a Ray actor, collectives over gloo (Ray may place ranks on
    other machines); the same greedy tokens as one process, on a tiny random Qwen3."""
    from model_utils import save_tiny_model
    from tokenizer_utils import load_smollm2_tokenizer
    save_tiny_model("qwen3", tmp_path, intermediate_size=96)
    load_smollm2_tokenizer().save_pretrained(str(tmp_path))
    kwargs = dict(model=str(tmp_path), dtype="float32", num_kv_blocks=32)
    prompts = [{"prompt_token_ids": [5, 9, 13, 200, 7, 3]}, {"prompt_token_ids": list(range(20, 45))}]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tp = LLM(tensor_parallel_size=2, distributed_executor_backend="ray", **kwargs)
    try:
        assert "tensor parallel 2 (ray, gloo all-reduce" in tp.llm_engine.parallel_description()
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)]
    finally:
        tp.llm_engine.shutdown()
    assert got == [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]


def test_parallel_flags():
    from kvserve.entrypoints.cli import build_parser, engine_config_from_args, main
    args = build_parser().parse_args(["serve", "-tp", "2", "--distributed-executor-backend", "ray", "--ray-address",
                                      "auto", "-dp", "3"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.distributed_executor_backend, config.ray_address,
            args.data_parallel_size) == (2, "ray", "auto", 3)
    assert main(["serve", "--data-parallel-size", "2"]) != 0   # replicas run on Ray: the backend must say so
