"""Prefix caching, measured side by side in one process (ratios, not absolute times).

  python benchmarks/prefix_caching.py [--dtype auto] [--system-len 1000] [--requests 32] [--json out.json]

1. TTFT of a request whose system prompt is cached vs the same request with a fresh cache_salt (a miss).
2. Peak KV blocks for n = 8 samples of one prompt (shared blocks) vs 8 separate requests without caching.
3. Throughput of requests that share a long system prompt, prefix caching on vs off.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

from kvserve import LLM, SamplingParams


def system_prompt(tok, num_tokens: int) -> list[int]:
    text = "You are a support assistant for Example Corp. Follow policy, be concise, and cite rules. "
    ids = tok.encode(text * (num_tokens // 15 + 1))
    return ids[:num_tokens]


def ttft(engine, prompt_ids, salt) -> float:
    start = time.perf_counter()
    engine.add_request(None, {"prompt_token_ids": prompt_ids, "cache_salt": salt},
                       SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def bench_ttft(llm, sys_ids, repeats=5) -> dict:
    engine = llm.llm_engine
    question = llm.get_tokenizer().encode(" Question: where is my order?")
    ttft(engine, sys_ids + question, "warm")                  # fills the cache under salt "warm"
    hits, misses = [], []
    for i in range(repeats):
        q = question + [100 + i]
        hits.append(ttft(engine, sys_ids + q, "warm"))
        misses.append(ttft(engine, sys_ids + q, uuid.uuid4().hex))
    hit, miss = statistics.median(hits), statistics.median(misses)
    return {"ttft_cached_s": hit, "ttft_uncached_s": miss, "speedup": miss / hit}


def peak_blocks(engine, add) -> int:
    free = engine.kv.num_free_blocks
    add()
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, free - engine.kv.num_free_blocks)
    return peak


def bench_memory(shared: LLM, unshared: LLM, sys_ids, n=8) -> dict:
    params = SamplingParams(n=n, max_tokens=32, ignore_eos=True, temperature=1.0, seed=0)
    one = SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0, seed=0)
    with_sharing = peak_blocks(shared.llm_engine, lambda: shared.llm_engine.add_request(
        None, {"prompt_token_ids": sys_ids}, params))
    without = peak_blocks(unshared.llm_engine, lambda: [unshared.llm_engine.add_request(
        None, {"prompt_token_ids": sys_ids}, one) for _ in range(n)])
    return {"n": n, "blocks_shared": with_sharing, "blocks_unshared": without, "ratio": without / with_sharing}


def bench_throughput(llm: LLM, sys_ids, num_requests) -> float:
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": sys_ids + tok.encode(f" Customer {i}: my order {i * 7} is late.")}
               for i in range(num_requests)]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs) / elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    on = LLM(dtype=args.dtype, enable_prefix_caching=True, max_model_len=2048, quantization="none")
    off = LLM(dtype=args.dtype, enable_prefix_caching=False, max_model_len=2048, quantization="none")
    sys_ids = system_prompt(on.get_tokenizer(), args.system_len)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "system_len": len(sys_ids), "dtype": str(on.llm_engine.dtype)}
    res["ttft"] = bench_ttft(on, sys_ids)
    print(f"TTFT, {len(sys_ids)}-token system prompt: cached {res['ttft']['ttft_cached_s'] * 1e3:.0f} ms, "
          f"uncached {res['ttft']['ttft_uncached_s'] * 1e3:.0f} ms -> {res['ttft']['speedup']:.1f}x")
    res["memory"] = bench_memory(on, off, sys_ids)
    print(f"KV blocks for n=8 samples: shared {res['memory']['blocks_shared']}, "
          f"unshared {res['memory']['blocks_unshared']} -> {res['memory']['ratio']:.1f}x less")
    tput_on, tput_off = bench_throughput(on, sys_ids, args.requests), bench_throughput(off, sys_ids, args.requests)
    res["throughput"] = {"requests": args.requests, "tok_s_on": tput_on, "tok_s_off": tput_off,
                         "ratio": tput_on / tput_off}
    print(f"{args.requests} requests sharing the system prompt: {tput_on:.0f} tok/s cached vs {tput_off:.0f} "
          f"tok/s uncached -> {tput_on / tput_off:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
