"""W1 offline against vLLM's CPU build in each of its dtypes, on this CPU or as an AVX2 one: kvserve's dense bf16
path (the bundled model dequantized to bf16) and `--quantization int8` against vLLM in float32 and bfloat16 (on the
HF bf16 copy of the same weights, `make peers`), alternating, each run in a process of its own, one workload for all
(benchmarks/compare.py's W1: 64 prompts of 64-512 tokens, 32-256 out, greedy).

  python benchmarks/w1_peers.py [--isa native|avx2] [--rounds 2] [--num-prompts 64]

`--isa avx2` runs every engine as an AVX2 CPU would (KVSERVE_KERNELS=no-avx512, oneDNN and ATen held to AVX2; vLLM's
own kernels may still use AVX-512 where its build has them): on an AVX2 machine, leave it at native. vLLM in
bfloat16 runs in the first round only (on a CPU without AVX-512 BF16 it is several times slower than in float32).
Needs vLLM's CPU build (`make peers`). Writes benchmarks/results/w1_peers_<isa>.json (a native run's <isa> names
the CPU's kind: native_avx2, native_avx512_bf16, ...), which compare_report.py puts in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from compare import (RESULTS, cpu_kind, cpu_name, ensure_hf_model, kvserve_offline, load_avg, make_workload,
                     vllm_available, vllm_offline)

AVX2_ENV = {"KVSERVE_KERNELS": "no-avx512", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
ENGINES = [("kvserve bf16", "kvserve", "none"), ("kvserve -q int8", "kvserve", "int8"),
           ("vLLM float32", "vllm", "float32"), ("vLLM bfloat16", "vllm", "bfloat16")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not (vllm_available() and ensure_hf_model()):
        raise SystemExit("w1_peers: needs vLLM's CPU build and the HF copy of the bundled model (make peers)")
    env = AVX2_ENV if args.isa == "avx2" else {}
    runs: dict[str, list[float]] = {name: [] for name, _, _ in ENGINES}
    with tempfile.TemporaryDirectory() as tmp:
        work_path = Path(tmp) / "w1.json"
        make_workload(work_path, args.num_prompts, args.seed)
        for r in range(args.rounds):
            for name, engine, setting in ENGINES:
                if setting == "bfloat16" and r > 0:
                    continue
                run_dir = Path(tempfile.mkdtemp(dir=tmp))   # a failed run leaves no figures of an earlier one
                out = (kvserve_offline(args, work_path, run_dir, setting, env) if engine == "kvserve"
                       else vllm_offline(args, work_path, run_dir, setting, env))
                if out is not None:
                    runs[name].append(out["output_tokens_per_s"])
    rows = [{"engine": name, "output_tok_s": v, "median": statistics.median(v) if v else None} for name, v in runs.items()]
    best_peer = max((r["median"] for r in rows if r["engine"].startswith("vLLM") and r["median"]), default=None)
    for row in rows:
        row["vs_best_vllm"] = round(row["median"] / best_peer, 2) if row["median"] and best_peer else None
    kind = cpu_kind()
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "kind": kind, "isa": args.isa,
              "load_avg": load_avg(), "num_prompts": args.num_prompts, "rounds": args.rounds, "rows": rows}
    # one file per ISA the engines ran: a native run's is the CPU's own kind
    isa = args.isa if args.isa == "avx2" else "native_" + kind.lower().replace("-", "").replace(" ", "_")
    path = RESULTS / f"w1_peers_{isa}.json"
    path.write_text(json.dumps(result, indent=1))
    for row in rows:
        print(f"{row['engine']:18s} {row['output_tok_s']} median {row['median']} -> {row['vs_best_vllm']}x vLLM's best")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
