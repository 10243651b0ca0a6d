"""Each CPU optimization switched on one after another, measured side by side in one process on a W1-style
workload (ratios against the first row; absolute figures on a shared machine are noise).

  python benchmarks/ablation.py [--num-prompts 16] [--repeats 2] [--num-threads N] [--json out.json]

Rows: the pure-torch path (reference attention backend, plain F.linear, unfused norm/rope/silu), then
+ C++ paged attention, + packed bf16 weights (the C++ matmul kernels; oneDNN where they do not build), + fused
bf16 RMSNorm/residual, RoPE and SiLU kernels.
Configurations are interleaved over the repeats and the best run of each is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import CpuPagedAttention, TorchPagedAttention, attention_layers
from kvserve.entrypoints.bench import random_workload
from kvserve.model import layers
from kvserve.model.layers import Linear

CONFIGS = ["torch ops only", "+ C++ paged attention", "+ packed bf16 weights", "+ fused norm/rope/silu"]


def configure(llm, level: int, packs: dict, fast_lib) -> None:
    model = llm.llm_engine.model
    backend = CpuPagedAttention() if level >= 1 else TorchPagedAttention()
    for a in attention_layers(model):
        a.backend = backend
    for m in model.modules():
        if isinstance(m, Linear):
            m.packed = packs.get(m) if level >= 2 else None
    model.packed_lm_head = packs.get("lm_head") if level >= 2 else None
    layers._fast_lib = fast_lib if level >= 3 else (lambda x: None)


def run(llm, work) -> float:
    prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in work]
    params = [SamplingParams(temperature=0, max_tokens=w["output_len"], ignore_eos=True) for w in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    llm = LLM(dtype="bfloat16", num_threads=args.num_threads, enable_prefix_caching=False)
    engine = llm.llm_engine
    model = engine.model
    packs = {m: m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None}
    packs["lm_head"] = model.packed_lm_head
    fast_lib = layers._fast_lib
    work = random_workload(args.num_prompts, (64, 512), (32, 256), 0, engine.vocab_size,
                           engine.tokenizer.all_special_ids)
    best = {c: 0.0 for c in CONFIGS}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for level, name in enumerate(CONFIGS):
            configure(llm, level, packs, fast_lib)
            best[name] = max(best[name], run(llm, work))
            print(f"{name:28s} {best[name]:7.1f} output tok/s (best so far), load {os.getloadavg()[0]:.2f}", flush=True)
            loads.append(os.getloadavg()[0])
    configure(llm, len(CONFIGS) - 1, packs, fast_lib)
    base = best[CONFIGS[0]]
    print(f"\n{args.num_prompts} requests, threads {torch.get_num_threads()}, load {min(loads):.2f}-{max(loads):.2f}")
    for name in CONFIGS:
        print(f"| {name} | {best[name]:.1f} | {best[name] / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_prompts": args.num_prompts, "threads": torch.get_num_threads(),
                       "load_range": [min(loads), max(loads)], "output_tokens_per_s": best}, f, indent=2)


if __name__ == "__main__":
    main()
