"""The cost of the distributed machinery, side by side in one process on the bundled model (or --model): start-up
time, single-stream TPOT and batch throughput of one process against tensor parallelism over 2 ranks (mp
backend), and of one AsyncLLMEngine against 2 data-parallel replicas on a local Ray instance (the server's
engines, no HTTP). On a 2-core machine no speedup is expected: each rank or replica gets one core, and the
figures say what the processes, messages and collectives cost.

    python benchmarks/distributed.py [--model PATH] [--num-prompts 16] [--output-json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig

PROMPT = "Write a short paragraph about the history of bread making in Europe."


def offline(kwargs: dict, num_prompts: int) -> dict:
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start = time.perf_counter() - t0
    one = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    t0 = time.perf_counter()
    out = llm.generate(PROMPT, one, use_tqdm=False)[0]
    single = time.perf_counter() - t0
    metrics = out.metrics
    tpot = (metrics["last_token_time"] - metrics["first_token_time"]) / (len(out.outputs[0].token_ids) - 1)
    batch = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([f"{PROMPT} ({i})" for i in range(num_prompts)], batch, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    llm.llm_engine.shutdown()
    return {"start_s": start, "tpot_ms": tpot * 1e3, "single_s": single,
            "batch_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed}


async def served(engine, num_prompts: int) -> float:
    """Output tokens per second of num_prompts concurrent requests through a server engine."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    async def one(i):
        stream = await engine.add_request(f"r{i}", {"prompt": f"{PROMPT} ({i})"}, params)
        n = 0
        async for out in engine.generate(stream):
            n += len(out.outputs[0].token_ids)
        return n

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one(i) for i in range(num_prompts))))
    return total / (time.perf_counter() - t0)


def data_parallel(config: EngineConfig, num_prompts: int) -> dict:
    import ray
    from kvserve.distributed.dp_engine import DataParallelEngine
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine
    results = {}
    t0 = time.perf_counter()
    single = AsyncLLMEngine(LLMEngine(config))
    results["one_engine_start_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False)
    results["ray_init_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dp = DataParallelEngine(EngineConfig(**{**config.__dict__, "distributed_executor_backend": "ray"}), 2, "m")
    results["dp2_start_s"] = time.perf_counter() - t0

    async def run(engine, key):
        engine.start()
        try:
            await served(engine, 2)   # warm-up
            results[key] = await served(engine, num_prompts)
        finally:
            await engine.stop()
    asyncio.run(run(single, "one_engine_tok_s"))
    asyncio.run(run(dp, "dp2_tok_s"))
    ray.shutdown()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    base = {"model": args.model, "dtype": "float32", "kv_cache_memory": "256MiB"}
    results = {"tp1": offline(base, args.num_prompts), "tp2": offline({**base, "tensor_parallel_size": 2},
                                                                       args.num_prompts)}
    results["dp"] = data_parallel(EngineConfig(**base), args.num_prompts)
    t1, t2, dp = results["tp1"], results["tp2"], results["dp"]
    print(f"start-up: one process {t1['start_s']:.1f} s, TP=2 {t2['start_s']:.1f} s; one engine "
          f"{dp['one_engine_start_s']:.1f} s, Ray init {dp['ray_init_s']:.1f} s + DP=2 {dp['dp2_start_s']:.1f} s")
    print(f"TPOT (1 request): TP=1 {t1['tpot_ms']:.1f} ms, TP=2 {t2['tpot_ms']:.1f} ms "
          f"({t2['tpot_ms'] / t1['tpot_ms']:.2f}x)")
    print(f"throughput ({args.num_prompts} requests): TP=1 {t1['batch_tok_s']:.1f} tok/s, TP=2 "
          f"{t2['batch_tok_s']:.1f} ({t2['batch_tok_s'] / t1['batch_tok_s']:.2f}x); one engine "
          f"{dp['one_engine_tok_s']:.1f}, DP=2 {dp['dp2_tok_s']:.1f} ({dp['dp2_tok_s'] / dp['one_engine_tok_s']:.2f}x)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
