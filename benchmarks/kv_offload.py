"""The host KV tier (kvserve/core/host_tier.py), side by side in one process on the bundled model:

  preemption  4 concurrent requests of 6,000-token prompts (256 tokens out each) in a pool that fits two prompts:
              total time with preemption_mode swap (the preempted requests' blocks kept in the tier) against
              recompute, with the prefix cache (blocks still in the pool are found again) and without it
  prefix      a 2,000-token system prompt served, then pushed out of the pool by other prompts, then asked again:
              time to its first token with the tier (loaded back) against without (recomputed), and a cold prefill

    python benchmarks/kv_offload.py [--prompt-len 6000] [--rounds 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve import LLM, SamplingParams   # noqa: E402


def _prompts(n: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(100, 20000, (length,), generator=g).tolist()} for _ in range(n)]


def preemption(mode: str, prompt_len: int, out_len: int) -> tuple[float, int]:
    """(seconds, preemptions) for 4 requests in a pool of two prompts' blocks. mode: swap, recompute (the
    preempted blocks stay cached in the pool until handed out again), or no-cache (recompute without the prefix
    cache: every preemption recomputes the whole context)."""
    blocks = 2 * -(-prompt_len // 16) + 1   # two prompts: their outputs, and the others, preempt
    llm = LLM(num_kv_blocks=blocks, max_num_seqs=4, max_model_len=prompt_len + out_len,
              preemption_mode="recompute" if mode == "no-cache" else mode, enable_prefix_caching=mode != "no-cache",
              swap_space="2GiB")
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(_prompts(4, prompt_len, 0), params, use_tqdm=False)
    return time.perf_counter() - start, llm.llm_engine.scheduler.stats().num_preemptions


def ttft(llm, prompt: dict) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def prefix(tier: bool, system_len: int = 2000) -> tuple[float, float]:
    """(cold TTFT, TTFT after the system prompt left the pool) of a system prompt plus a short question."""
    pool = 2 * -(-system_len // 16) + 8
    llm = LLM(num_kv_blocks=pool, max_model_len=system_len + 64, kv_offloading_size="1GiB" if tier else 0)
    system = _prompts(1, system_len, 1)[0]["prompt_token_ids"]
    ask = lambda q: {"prompt_token_ids": system + q}   # noqa: E731
    cold = ttft(llm, ask([11, 12, 13]))
    for other in _prompts(2, system_len, 2):   # two other long prompts turn the pool over
        ttft(llm, other)
    return cold, ttft(llm, ask([21, 22, 23]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=6000)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    runs: dict = {"no-cache": [], "recompute": [], "swap": []}
    for _ in range(args.rounds):   # interleaved: the machine's drift hits every mode alike
        for mode in runs:
            runs[mode].append(preemption(mode, args.prompt_len, args.output_len))
    for mode, r in runs.items():
        print(f"preemption {mode}: {', '.join(f'{s:.1f} s ({n} preemptions)' for s, n in r)}", flush=True)
    swap = statistics.median(s for s, _ in runs["swap"])
    print(", ".join(f"swap / {mode}: {swap / statistics.median(s for s, _ in runs[mode]):.2f}"
                    for mode in ("no-cache", "recompute")))
    for _ in range(args.rounds):
        cold, without = prefix(False)
        _, with_tier = prefix(True)
        print(f"prefix: cold {cold * 1e3:.0f} ms; after eviction without the tier {without * 1e3:.0f} ms, with it "
              f"{with_tier * 1e3:.0f} ms ({with_tier / cold:.2f} of cold)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
