"""FP8 KV cache against the model's dtype, side by side in one run, on the bundled model (or --model):
offline throughput of many requests in a small KV pool (where FP8's 4x tokens over float32, 2x over bf16, let more
requests run at once) and single-stream TPOT at a long context (where attention reads the pools every step).

    python benchmarks/fp8_kv.py [--model PATH] [--kv-cache-memory 48MiB] [--output-json FILE]

Throughput: 32 requests, prompts 128-384 tokens, outputs 64-128; latency: one 1,536-token prompt, 32 tokens out.

Each configuration runs in its own `kvserve bench` process. Machines of this kind differ from day to day: read the
ratios, measured in one run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = [("auto", []), ("fp8", ["--kv-cache-dtype", "fp8", "--calculate-kv-scales"])]


def bench(kind: str, args: list[str]) -> dict:
    """One `kvserve bench KIND ARGS` process: its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "kvserve", "bench", kind, *args, "--output-json", out.name]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--kv-cache-memory", default="48MiB", help="the pool of the throughput runs")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    model = ["--model", args.model] if args.model else []
    rows = []
    for name, flags in CONFIGS:
        t = bench("throughput", [*model, *flags, "--kv-cache-memory", args.kv_cache_memory, "--num-prompts", "32",
                                 "--input-len", "128:384", "--output-len", "64:128", "--no-tqdm"])
        lat = bench("latency", [*model, *flags, "--input-len", "1536", "--output-len", "32", "--num-iters", "1",
                                "--num-iters-warmup", "1"])
        rows.append({"kv_cache_dtype": name, "output_tok_s": t["output_tokens_per_s"],
                     "tpot_ms_at_1536": lat["tpot_ms"]["mean"], "ttft_ms_at_1536": lat["ttft_ms"]["mean"]})
    base = rows[0]
    for r in rows:
        print(f"kv {r['kv_cache_dtype']:5s} throughput {r['output_tok_s']:7.1f} output tok/s "
              f"({r['output_tok_s'] / base['output_tok_s']:.2f}x)  TPOT at 1536 {r['tpot_ms_at_1536']:6.2f} ms "
              f"({r['tpot_ms_at_1536'] / base['tpot_ms_at_1536']:.2f}x)  TTFT {r['ttft_ms_at_1536']:7.1f} ms")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
