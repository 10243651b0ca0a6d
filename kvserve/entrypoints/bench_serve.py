"""`kvserve bench serve`: a serving benchmark client for any OpenAI-compatible server (`kvserve serve`, vLLM).

It sends `vllm bench serve`'s random workload to /v1/completions: N prompts of random token ids (special tokens
never drawn, the ids sent as the prompt, so every request has exactly its input length), streaming, greedy,
ignore_eos, all at once or `--request-rate` per second (Poisson arrivals), at most `--max-concurrency` in flight.
It prints and (with `--output-json`) writes the figures under `vllm bench serve`'s names: output_throughput,
mean/median/p99 TTFT, TPOT (per request: (latency - TTFT) / (output tokens - 1)) and ITL (gaps between streamed
chunks), in ms; output tokens are the server's usage counts (stream_options.include_usage), else max_tokens.
Token ids are drawn with the model's tokenizer (`--model`/`--tokenizer`, default: the bundled SmolLM2) by the
random_workload that `bench throughput` uses.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kvserve.entrypoints.bench import _special_ids, _write_json, parse_range, random_workload


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0              # s from sending to the first streamed text
    latency: float = 0.0           # s from sending to the end of the stream
    itl: list[float] = field(default_factory=list)   # s between streamed chunks after the first
    output_tokens: int = 0


async def _send(client, url: str, payload: dict) -> RequestResult:
    res = RequestResult()
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=payload) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                try:
                    res.error = f"HTTP {r.status_code}: {json.loads(body)['error']['message']}"
                except (ValueError, KeyError, TypeError):
                    res.error = f"HTTP {r.status_code}: {body[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    return res
                if chunk.get("usage"):
                    res.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    except Exception as e:   # connection refused or reset, a timeout: the request failed, the run goes on
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - t0
    if last is None:
        res.error = "the stream ended without any output"
        return res
    res.ok = True
    return res


def _percentiles(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1000 if values_s else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


async def _run(args, work: list[dict], model: str, headers: dict) -> tuple[list[RequestResult], float]:
    import httpx
    url = args.base_url.rstrip("/") + args.endpoint
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed)
    gaps = (rng.exponential(1.0 / args.request_rate, len(work)) if args.request_rate != float("inf")
            else np.zeros(len(work)))
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        async def one(w: dict) -> RequestResult:
            payload = {"model": model, "prompt": w["prompt_token_ids"], "max_tokens": w["output_len"],
                       "temperature": 0.0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}
            if limit is None:
                return await _send(client, url, payload)
            async with limit:
                return await _send(client, url, payload)

        t0 = time.perf_counter()
        tasks = []
        for w, gap in zip(work, gaps):
            if gap:
                await asyncio.sleep(float(gap))
            tasks.append(asyncio.create_task(one(w)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def _served_model(args, headers: dict) -> str:
    """--served-model-name, else the first model the server lists."""
    import httpx
    if args.served_model_name:
        return args.served_model_name
    url = args.base_url.rstrip("/") + "/v1/models"
    try:
        r = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise SystemExit(f"kvserve bench serve: cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise SystemExit(f"kvserve bench serve: GET {url} answered HTTP {r.status_code}: {r.text[:300]}")
    models = r.json().get("data") or []
    if not models:
        raise SystemExit(f"kvserve bench serve: {url} lists no model; pass --served-model-name")
    return models[0]["id"]


def run_serve_bench(args) -> dict:
    """Run the workload against the server; returns the figures (also printed)."""
    from kvserve.model.tokenizer import load_tokenizer
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("kvserve bench serve: --max-concurrency must be >= 1")
    if not args.request_rate > 0:
        raise SystemExit("kvserve bench serve: --request-rate must be > 0 (inf: all at once)")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = _served_model(args, headers)
    tok = load_tokenizer(args.model, args.tokenizer)
    work = random_workload(args.num_prompts, args.input_len, args.output_len, args.seed, len(tok),
                           _special_ids(tok))
    results, duration = asyncio.run(_run(args, work, model, headers))
    done = [(w, r) for w, r in zip(work, results) if r.ok]
    errors = [r.error for r in results if not r.ok]
    num_in = sum(len(w["prompt_token_ids"]) for w, _ in done)
    num_out = sum(r.output_tokens or w["output_len"] for w, r in done)
    tpots = [(r.latency - r.ttft) / (n - 1) for w, r in done if (n := r.output_tokens or w["output_len"]) > 1]
    result = {
        "backend": "openai", "base_url": args.base_url, "endpoint": args.endpoint, "model_id": model,
        "num_prompts": args.num_prompts, "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "duration": duration, "completed": len(done), "failed": len(errors), "total_input_tokens": num_in,
        "total_output_tokens": num_out, "request_throughput": len(done) / duration,
        "output_throughput": num_out / duration, "total_token_throughput": (num_in + num_out) / duration,
        **_percentiles("ttft", [r.ttft for _, r in done]), **_percentiles("tpot", tpots),
        **_percentiles("itl", [x for _, r in done for x in r.itl]),
        **_percentiles("e2el", [r.latency for _, r in done]),
        "errors": sorted(set(errors))[:5],
    }
    _print(result)
    _write_json(args, result)
    if not done:
        raise SystemExit(f"kvserve bench serve: every request failed; first error: {errors[0]}")
    return result


def _print(r: dict) -> None:
    rows = [("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
            ("Benchmark duration (s)", f"{r['duration']:.2f}"), ("Total input tokens", r["total_input_tokens"]),
            ("Total generated tokens", r["total_output_tokens"]),
            ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.2f}")]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        rows += [(f"{kind} {label} (ms)", f"{r[f'{key}_{name}_ms']:.2f}")
                 for kind, key in (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))]
    print("=" * 50)
    for name, value in rows:
        print(f"{name + ':':<40}{value:>10}")
    print("=" * 50)
    for e in r["errors"]:
        print(f"error: {e}", file=sys.stderr)


def add_serve_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `kvserve bench serve` (vllm bench serve's names where they exist)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--served-model-name", default=None, help="the model name to ask for (default: the first listed)")
    p.add_argument("--model", default=None, help="model path whose tokenizer draws the prompts (default: bundled)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path, when not the model's")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=parse_range("256"), help="N or A:B (default: 256)")
    p.add_argument("--output-len", type=parse_range, default=parse_range("128"), help="N or A:B (default: 128)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    p.set_defaults(bench_func=run_serve_bench)
