"""Each CPU optimization switched on one after another, measured side by side in one process on a W1-style
workload (ratios against the first row; absolute figures on a shared machine are noise).

  python benchmarks/ablation.py [--num-prompts 16] [--repeats 2] [--num-threads N] [--json out.json]
  python benchmarks/ablation.py --single-stream [--repeats 4]   # TPOT of one request, 256 in / 128 out

Rows: the pure-torch path (reference attention backend, plain F.linear, unfused norm/rope/silu), then
+ C++ paged attention, + packed bf16 weights (the C++ matmul kernels; oneDNN where they do not build), + fused
bf16 RMSNorm/residual, RoPE and SiLU kernels, + all decoder layers in one C++ call (kvserve/model/fused.py),
+ decode-only steps of 24+ sequences shared out between the threads, each running the whole stack on its share.
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
from kvserve.model.layers import Linear, restore_unpacked_weights
from kvserve.model.linear_method import DENSE

CONFIGS = ["torch ops only", "+ C++ paged attention", "+ packed bf16 weights", "+ fused norm/rope/silu",
           "+ one-call layer stack", "+ decode batches split between threads"]


def configure(llm, level: int, packs: dict, fast_lib) -> None:
    model = llm.llm_engine.model
    backend = CpuPagedAttention() if level >= 1 else TorchPagedAttention()
    for a in attention_layers(model):
        a.backend = backend
    for m in model.modules():
        if isinstance(m, Linear):
            m.method = packs.get(m, DENSE) if level >= 2 else DENSE
    model.tied_head = packs.get("lm_head") if level >= 2 else DENSE
    layers._fast_lib = fast_lib if level >= 3 else (lambda x: None)
    model.model.use_fused_layers = level >= 4
    model.model.split_decode_batches = level >= 5


def single_stream_tpot_ms(llm, prompt: list[int], out_len: int = 128) -> float:
    """Decode time per token of one request: (time to out_len + 1 tokens - time to 1 token) / out_len."""
    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t0
    first = timed(1)
    return (timed(out_len + 1) - first) / out_len * 1e3


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
    p.add_argument("--single-stream", action="store_true",
                   help="decode TPOT of one 256-token request instead of W1 throughput (lower is better)")
    args = p.parse_args()
    llm = LLM(dtype="bfloat16", num_threads=args.num_threads, enable_prefix_caching=False, quantization="none")
    engine = llm.llm_engine
    model = engine.model
    restore_unpacked_weights(model)   # the configurations without packs run F.linear on them
    packs = {m: m.method for m in model.modules() if isinstance(m, Linear) and m.method is not DENSE}
    packs["lm_head"] = model.tied_head
    fast_lib = layers._fast_lib
    work = random_workload(args.num_prompts, (64, 512), (32, 256), 0, engine.vocab_size,
                           engine.tokenizer.all_special_ids)
    prompt = (work[0]["prompt_token_ids"] * 8)[:256]   # W1 prompts have 64-512 tokens; the single stream 256
    unit = "ms TPOT" if args.single_stream else "output tok/s"
    better = min if args.single_stream else max
    best: dict[str, float] = {}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for level, name in enumerate(CONFIGS):
            configure(llm, level, packs, fast_lib)
            got = single_stream_tpot_ms(llm, prompt) if args.single_stream else run(llm, work)
            best[name] = better(best.get(name, got), got)
            print(f"{name:28s} {best[name]:7.2f} {unit} (best so far), load {os.getloadavg()[0]:.2f}", flush=True)
            loads.append(os.getloadavg()[0])
    configure(llm, len(CONFIGS) - 1, packs, fast_lib)
    base = best[CONFIGS[0]]
    what = "one request, 256 in / 128 out" if args.single_stream else f"{args.num_prompts} requests"
    print(f"\n{what}, threads {torch.get_num_threads()}, load {min(loads):.2f}-{max(loads):.2f}")
    for name in CONFIGS:
        speedup = base / best[name] if args.single_stream else best[name] / base
        print(f"| {name} | {best[name]:.2f} {unit} | {speedup:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            key = "tpot_ms" if args.single_stream else "output_tokens_per_s"
            json.dump({"num_prompts": 1 if args.single_stream else args.num_prompts,
                       "threads": torch.get_num_threads(), "load_range": [min(loads), max(loads)], key: best},
                      f, indent=2)


if __name__ == "__main__":
    main()
