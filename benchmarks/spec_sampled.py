"""Speculative decoding of sampled requests with a draft model: drafts drawn from the draft's distribution against
the draft's argmax, side by side in one process (ratios against "off").

  python benchmarks/spec_sampled.py [--temperatures 0.5,1.0] [--tokens 64] [--repeats 2] [--num-threads N]
                                    [--json benchmarks/results/spec_sampled.json]

Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) with Qwen2.5-Coder-0.5B-Instruct as the draft (`make models`), the draft
section's 2 code prompts of benchmarks/spec_decode.py, random sampling at each temperature (top-p 1, no seed,
ignore_eos so that every run makes --tokens tokens). Configurations, switched on one engine between runs: off;
draft k=3 drawing its drafts from its distribution q, kept with probability min(1, p/q) (what the engine does for
random requests without a seed); draft k=3 proposing its argmax, kept when the target samples it (what it does for
greedy and seeded requests; here on unseeded requests, so that only the drafting differs). TPOT as in
spec_decode.py: (time with max_tokens=N - time with max_tokens=1) / (N - 1), the median over the repeats, the
configurations interleaved. The outputs are random, so they are not compared; acceptance from spec_stats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvserve.spec_decode.draft_sampling as draft_sampling   # noqa: E402
from kvserve import SamplingParams   # noqa: E402
from spec_decode import (ROOT, acceptance, add_counts, chat_ids, log, make_llm, spec_counts,   # noqa: E402
                         switch_speculation, timed_generate)
from spec_prompts import DRAFT_PROMPTS   # noqa: E402

CONFIGS = ("off", "draft k=3, drawn drafts", "draft k=3, argmax drafts")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "spec_sampled.json"))
    args = p.parse_args()
    from kvserve.model.fetch import model_path
    target, draft = model_path("qwen2.5-coder-1.5b"), model_path("qwen2.5-coder-0.5b")
    if target is None or draft is None:
        sys.exit("the Qwen2.5-Coder GGUFs are not fetched (make models)")
    # the whole vocabulary, as docs/speculative_decoding.md's figures were measured (drawn against argmax drafts)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "draft_vocab_size": None}
    llm = make_llm(str(target), spec, args, max_model_len=1024, kv_cache_memory="256MiB")
    draft_model, drawing = llm.llm_engine.runner.draft_model, draft_sampling.draws_drafts
    prompts = chat_ids(llm, DRAFT_PROMPTS)

    def switch(name: str) -> None:
        switch_speculation(llm, None if name == "off" else spec, draft_model)
        draft_sampling.draws_drafts = drawing if "drawn" in name else (lambda req: False)

    t0 = time.perf_counter()
    rows = {}
    for temperature in args.temperatures:
        params = lambda n: SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
        samples = {name: [[] for _ in prompts] for name in CONFIGS}
        counts = {name: {} for name in CONFIGS}
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                for name in CONFIGS[rep % 3:] + CONFIGS[:rep % 3]:
                    switch(name)
                    t_first, _ = timed_generate(llm, [ids], params(1))
                    before = spec_counts(llm)
                    t_all, (out,) = timed_generate(llm, [ids], params(args.tokens))
                    add_counts(counts[name], before, spec_counts(llm))
                    samples[name][i].append((t_all - t_first) / (len(out) - 1))
                    log(f"T={temperature} rep {rep + 1} prompt {i} {name:26s} TPOT {samples[name][i][-1] * 1e3:6.1f} ms"
                        f", load {os.getloadavg()[0]:.2f}")
        for name in CONFIGS:
            tpot = statistics.mean(statistics.median(s) for s in samples[name])
            rows[f"T={temperature}, {name}"] = {"temperature": temperature, "tpot_ms": 1e3 * tpot,
                                                "samples_ms": [[round(1e3 * x, 2) for x in s] for s in samples[name]],
                                                **counts[name], **acceptance(counts[name])}
        off = rows[f"T={temperature}, off"]["tpot_ms"]
        for name in CONFIGS:
            rows[f"T={temperature}, {name}"]["speedup"] = off / rows[f"T={temperature}, {name}"]["tpot_ms"]
    switch("draft k=3, drawn drafts")
    fmt = lambda x, spec: "—" if x is None else format(x, spec)
    lines = [f"sampled requests, Qwen2.5-Coder-1.5B target / 0.5B draft, {len(prompts)} code prompts, "
             f"{args.tokens} tokens, median of {args.repeats}", "",
             "| config | TPOT ms | speedup | acceptance rate | mean acceptance length |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tpot_ms']:.1f} | {r['speedup']:.2f}× | {fmt(r['acceptance_rate'], '.1%')} | "
                     f"{fmt(r['mean_acceptance_length'], '.2f')} |")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(),
              "wall_s": round(time.perf_counter() - t0, 1), "command": " ".join(["python", *sys.argv]),
              "target": Path(target).name, "draft": Path(draft).name, "tokens": args.tokens,
              "repeats": args.repeats, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
