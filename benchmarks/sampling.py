"""The cost of random sampling: the same engine decoding greedily and at temperature 1, side by side in one process.

  python benchmarks/sampling.py [--model PATH] [--repeats 3] [--json benchmarks/results/sampling.json]

One request (a chat prompt, 128 tokens, ignore_eos: TPOT = (time with max_tokens=128 - time with max_tokens=1) /
127) and 64 concurrent requests (64 tokens each: output tokens per second), greedy and at temperature 1, the two
alternating, median of the repeats. The ratio temperature 1 / greedy is what drawing a token costs beyond the
argmax: the distribution's softmax, one uniform and a cumulative sum per row (kvserve.sample.sampler).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "sampling.json"))
    args = p.parse_args()
    llm = LLM(model=args.model, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": llm.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}])}
    samples = {}
    for _ in range(args.repeats):
        for name, temperature in (("greedy", 0.0), ("temperature 1", 1.0)):
            params = lambda n: SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
            first = timed(llm, [prompt], params(1))
            tpot = (timed(llm, [prompt], params(128)) - first) / 127
            samples.setdefault(f"{name}, one request: TPOT ms", []).append(1e3 * tpot)
            samples.setdefault(f"{name}, 64 requests: output tok/s", []).append(64 * 64 / timed(llm, [prompt] * 64,
                                                                                                 params(64)))
    rows = {k: statistics.median(v) for k, v in samples.items()}
    lines = ["| | greedy | temperature 1 | ratio |", "|---|---:|---:|---:|"]
    for what in ("one request: TPOT ms", "64 requests: output tok/s"):
        g, t = rows[f"greedy, {what}"], rows[f"temperature 1, {what}"]
        lines.append(f"| {what} | {g:.2f} | {t:.2f} | {t / g:.2f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model or "bundled",
                                           "command": " ".join(["python", *sys.argv]), "medians": rows,
                                           "samples": samples}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
