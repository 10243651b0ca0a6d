"""Disaggregated prefill/decode (kvserve proxy + a SharedStorageConnector pair) against one engine, side by side
on this machine, through HTTP:

  one engine   kvserve serve on every core
  P/D          a prefill instance on core 0 and a decode instance on core 1 (taskset, one thread each), kvserve
               proxy in front

Workload: `--chats` clients each stream short chats one after another (a distinct ~40-token prompt, `--chat-out`
tokens), while long prompts (`--long-len` random tokens, `--long-out` tokens out) arrive `--rate` times a second.
Reported: the chats' inter-token latency (p50, p99) and time to first token, the long prompts' time to first
token. Results: benchmarks/results/pd_disaggregation.json.

    python benchmarks/pd_disaggregation.py [--duration 30] [--rate 2] [--long-len 256]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, args: list[str], cpus: str | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        prefix = ["taskset", "-c", cpus] if cpus else []
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-bench-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "kvserve", *args, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(open(self.log.name).read())
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(open(self.log.name).read())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        os.unlink(self.log.name)


def serve_flags(threads: int, connector: dict | None) -> list[str]:
    flags = ["serve", "--num-threads", str(threads), "--max-model-len", "4096", "--kv-cache-memory", "1GiB"]
    return flags + (["--kv-transfer-config", json.dumps(connector)] if connector else [])


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the streamed tokens (the request's start first)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = [time.perf_counter()]
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return times


async def workload(url: str, args) -> dict:
    rng = random.Random(0)
    itl, chat_ttft, long_ttft = [], [], []
    end = time.perf_counter() + args.duration

    async def chats(client):
        while time.perf_counter() < end:
            times = await stream(client, url, [rng.randrange(100, 20000) for _ in range(40)], args.chat_out)
            chat_ttft.append(times[1] - times[0])
            itl.extend(b - a for a, b in zip(times[1:], times[2:]))

    async def long_one(client):
        times = await stream(client, url, [rng.randrange(100, 20000) for _ in range(args.long_len)], args.long_out)
        long_ttft.append(times[1] - times[0])

    async with httpx.AsyncClient(timeout=None) as client:
        workers = [asyncio.create_task(chats(client)) for _ in range(args.chats)]
        longs = []
        while time.perf_counter() < end:
            longs.append(asyncio.create_task(long_one(client)))
            await asyncio.sleep(1 / args.rate)
        await asyncio.gather(*workers, *longs)

    def pct(values, q):
        return round(statistics.quantiles(values, n=100)[q - 1] * 1000, 1) if len(values) > 1 else None
    return {"chat_itl_p50_ms": pct(itl, 50), "chat_itl_p99_ms": pct(itl, 99), "chat_ttft_p50_ms": pct(chat_ttft, 50),
            "chat_ttft_p99_ms": pct(chat_ttft, 99), "long_ttft_p50_ms": pct(long_ttft, 50),
            "long_ttft_p99_ms": pct(long_ttft, 99), "chat_tokens": len(itl), "long_prompts": len(long_ttft)}


def run_setup(name: str, args) -> dict:
    procs = []
    store = tempfile.mkdtemp(prefix="kvserve-pd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        if name == "one engine":
            procs.append(Proc(serve_flags(2, None)))
            url = procs[0].url
        else:
            conn = {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": store}}
            procs.append(Proc(serve_flags(1, {**conn, "kv_role": "kv_producer"}), cpus="0"))
            procs.append(Proc(serve_flags(1, {**conn, "kv_role": "kv_consumer"}), cpus="1"))
            procs.append(Proc(["proxy", "--prefill", procs[0].url, "--decode", procs[1].url]))
            url = procs[2].url
        for p in procs:
            p.wait()
        asyncio.run(warm(url))
        return asyncio.run(workload(url, args))
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(store, ignore_errors=True)


async def warm(url: str) -> None:
    async with httpx.AsyncClient(timeout=None) as client:
        await stream(client, url, list(range(100, 400)), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=2.0, help="long prompts a second")
    p.add_argument("--long-len", type=int, default=256)
    p.add_argument("--long-out", type=int, default=8)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-out", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/pd_disaggregation.json"))
    args = p.parse_args()
    results = {name: run_setup(name, args) for name in ("one engine", "P/D")}
    ratio = results["P/D"]["chat_itl_p99_ms"] / results["one engine"]["chat_itl_p99_ms"]
    print(f"{'setup':<12} {'ITL p50':>8} {'ITL p99':>8} {'chat TTFT p99':>14} {'long TTFT p50':>14} "
          f"{'long TTFT p99':>14} {'chat tokens':>12} {'long prompts':>13}")
    for name, r in results.items():
        print(f"{name:<12} {r['chat_itl_p50_ms']:>8} {r['chat_itl_p99_ms']:>8} {r['chat_ttft_p99_ms']:>14} "
              f"{r['long_ttft_p50_ms']:>14} {r['long_ttft_p99_ms']:>14} {r['chat_tokens']:>12} "
              f"{r['long_prompts']:>13}")
    print(f"chats' p99 inter-token latency, P/D / one engine: {ratio:.2f}")
    out = Path(args.out)   # one entry per scenario (long prompt length and rate)
    data = json.loads(out.read_text()) if out.exists() else {}
    data[f"long{args.long_len}_rate{args.rate:g}"] = {"cpu": cpu_name(), "args": vars(args), "results": results,
                                                      "itl_p99_ratio": round(ratio, 3)}
    out.write_text(json.dumps(data, indent=1) + "\n")


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    return "unknown"


if __name__ == "__main__":
    main()
