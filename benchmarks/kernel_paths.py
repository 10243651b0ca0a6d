"""What each kernel path costs on this CPU: the same engine and workload on every kernel variant, side by side.

Variants (kvserve/kernels.py): native (what this CPU supports), no-avx512 (on a CPU with AVX-512: the native
build without it, what an AVX2 CPU runs), no-avx512bf16 (on a CPU with AVX-512 BF16: what an AVX-512 CPU without
it runs), portable (the plain C++ build) and none (no compiler: plain torch). For
each dtype given, every variant runs the same random
workload offline (output tok/s, greedy, ignore_eos) and one request alone (TPOT), in one process, repeats
interleaved so the machine's drift hits every variant alike.

    python benchmarks/kernel_paths.py [--dtype float32 bfloat16] [--num-prompts 16] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.entrypoints.bench import random_workload


def measure(dtype: str, variant: str, work: list[dict], single_len: int) -> dict:
    with kernels.variant(variant):
        llm = LLM(dtype=dtype, max_model_len=1024, kv_cache_memory="1GiB", quantization="none")
        summary = llm.llm_engine.kernel_summary
        prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in work]
        params = [SamplingParams(temperature=0, max_tokens=w["output_len"], ignore_eos=True) for w in work]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        num_out = sum(len(o.outputs[0].token_ids) for o in outs)
        one = SamplingParams(temperature=0, max_tokens=single_len, ignore_eos=True)
        m = llm.generate(prompts[:1], one, use_tqdm=False)[0].metrics
    return {"dtype": dtype, "variant": variant, "kernels": summary, "output_tok_s": num_out / elapsed,
            "tpot_ms": 1000 * (m["last_token_time"] - m["first_token_time"]) / (single_len - 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["float32"])
    p.add_argument("--variants", nargs="+", default=None, help="default: every variant that differs here")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.variants is None:   # a variant without a feature the CPU lacks is the native build
        args.variants = [v for v in kernels.VARIANTS if kernels.differs_here(v)]
    work = random_workload(args.num_prompts, (args.input_len, args.input_len), (args.output_len, args.output_len),
                           0, 49152)
    runs: dict[tuple[str, str], list[dict]] = {}
    for i in range(args.repeats):
        for dtype in args.dtype:
            for variant in args.variants:
                r = measure(dtype, variant, work, args.output_len)
                runs.setdefault((dtype, variant), []).append(r)
                print(f"run {i + 1}: {dtype} {variant}: {r['output_tok_s']:.1f} output tok/s, TPOT "
                      f"{r['tpot_ms']:.2f} ms", flush=True)
    print(f"{torch.get_num_threads()} threads; {args.num_prompts} prompts x {args.input_len} in / "
          f"{args.output_len} out; medians of {args.repeats}")
    print(f"{'dtype':9} {'variant':9} {'output tok/s':>12} {'TPOT ms':>8}  kernels")
    rows = []
    for (dtype, variant), rs in runs.items():
        row = {"dtype": dtype, "variant": variant, "kernels": rs[0]["kernels"],
               "output_tok_s": round(statistics.median(r["output_tok_s"] for r in rs), 1),
               "tpot_ms": round(statistics.median(r["tpot_ms"] for r in rs), 2)}
        rows.append(row)
        print(f"{dtype:9} {variant:9} {row['output_tok_s']:12.1f} {row['tpot_ms']:8.2f}  {row['kernels']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
