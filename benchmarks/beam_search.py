"""Beam search's cost against greedy decoding, side by side in one process on the bundled model: the time per
generated token (a beam search step gives every beam one token) of LLM.beam_search at widths 2 and 4 against
LLM.generate greedy, the same prompts (--prompt-len random tokens), --tokens tokens, alternating runs.

    python benchmarks/beam_search.py [--prompt-len 200] [--tokens 48] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve import LLM, SamplingParams   # noqa: E402
from kvserve.entrypoints.beam_search import BeamSearchParams   # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results/beam_search.json"))
    args = p.parse_args()
    llm = LLM()
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(args.prompt_len)]}
    runs = {"greedy": lambda: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.tokens,
                                                                  ignore_eos=True), use_tqdm=False)}
    for width in (2, 4):
        params = BeamSearchParams(beam_width=width, max_tokens=args.tokens, ignore_eos=True)
        runs[f"beam {width}"] = lambda params=params: llm.beam_search(prompt, params)
    times = {name: [] for name in runs}
    for r in range(args.rounds + 1):   # the first round warms up
        for name, run in runs.items():
            llm.reset_prefix_cache()
            start = time.perf_counter()
            run()
            if r:
                times[name].append((time.perf_counter() - start) / args.tokens * 1000)
    per_token = {name: statistics.median(t) for name, t in times.items()}
    for name, ms in per_token.items():
        print(f"{name:<8} {ms:7.2f} ms per token ({ms / per_token['greedy']:.2f}x greedy)")
    Path(args.out).write_text(json.dumps({"args": vars(args), "ms_per_token": per_token,
                                          "ratio_to_greedy": {n: round(v / per_token["greedy"], 3)
                                                              for n, v in per_token.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
