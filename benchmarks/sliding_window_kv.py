"""KV blocks a long Gemma 3 conversation holds with the sliding-window layers' blocks given back (KV groups,
kvserve/core/kv_groups.py), against what full attention on every layer would hold, on the real Gemma-3-270M GGUF
(`make models`). A prompt of N tokens is computed and a few tokens decoded; the pool's held pages are read while
the request runs. Also prints the step times, so that a change to the groups' bookkeeping shows in them.

    python benchmarks/sliding_window_kv.py [--tokens 16000] [--decode 16]
"""
from __future__ import annotations

import argparse
import time

from kvserve import LLM, SamplingParams
from kvserve.core.kv_groups import cdiv
from kvserve.model.fetch import model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16000)
    parser.add_argument("--decode", type=int, default=16)
    args = parser.parse_args()
    path = model_path("gemma-3-270m")
    if path is None:
        raise SystemExit("Gemma-3-270M is not fetched: make models")
    llm = LLM(model=str(path), max_model_len=args.tokens + args.decode + 1)
    engine = llm.llm_engine
    kv, bs = engine.kv, engine.block_size
    layers = len(engine.model.model.layers)
    prompt = [2] + [(i * 7919) % 200000 + 1000 for i in range(args.tokens - 1)]
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=args.decode, temperature=0, ignore_eos=True))
    start, steps, peak = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if engine.has_unfinished_requests():   # the request's pages, before it finishes and gives them all back
            peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)
    elapsed = time.perf_counter() - start
    full_pages = cdiv(args.tokens + args.decode, bs) * layers / kv.groups.group_size
    print(f"Gemma-3-270M, {args.tokens}-token prompt + {args.decode} decoded, block size {bs}: "
          f"{kv.groups.describe()}")
    print(f"pages held at most: {peak} of {kv.num_usable_blocks}; full attention on every layer: {full_pages:.0f} "
          f"pages of the same size -> {peak / full_pages:.1%}")
    print(f"{steps} steps in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
