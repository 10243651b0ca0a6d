"""GGUF kept quantized, int8 (W8A8) and dequantized, and llama.cpp on the same file, side by side in one run:
single-stream TPOT and TTFT (prompt 256, output 128, greedy, EOS ignored) and resident memory; with --throughput,
offline throughput of 16 requests (prompts 64-256, outputs 32-128 tokens) per kvserve configuration.

    python benchmarks/quantization.py [--models smollm2 qwen1.5b FILE.gguf]
        [--llama-cpp ~/peers/llama.cpp-src/build/bin]
        [--configs gguf int8 none] [--dtypes auto float32] [--iters 3] [--rounds 1] [--throughput [--vllm]]
        [--llama-file gguf|bf16] [--output-json benchmarks/results/quantization.json]

kvserve runs in a subprocess per configuration (`kvserve bench latency`), with a 256 MiB KV pool; its memory is
the process's resident set after the engine started and its peak (/usr/bin/time). llama.cpp runs llama-bench
(-p 256 -n 128 -t 2; its figures are tokens/s of a prompt batch and of generation) and its peak resident set.
Machines of this kind differ from day to day, and drift within minutes: read the ratios, measured in one run, and
with --rounds N every engine runs N times in turn (the table gives medians, and the TPOT ratio of each round).
`--llama-file bf16` gives llama.cpp the bf16 GGUF of the model's HF copy (made once with llama.cpp's own
convert_hf_to_gguf.py, beside the copy under $PEERS) instead of the quantized file: with `--configs none`, a dense
bf16 checkpoint in both engines, the same weights.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {"smollm2": None, "qwen1.5b": "qwen2.5-coder-1.5b", "qwen0.5b": "qwen2.5-coder-0.5b"}
# the bf16 Hugging Face copies benchmarks/peers/make-hf-model.py writes (make hf-models): int8
# and none load them where present, as a user quantizing a bf16 checkpoint would
HF_COPIES = {"smollm2": "smollm2-135m-instruct", "qwen1.5b": "qwen2.5-coder-1.5b-instruct",
             "qwen0.5b": "qwen2.5-coder-0.5b-instruct"}


def hf_copy(name: str) -> str | None:
    """The model's bf16 HF copy under $PEERS, where make hf-models wrote one."""
    if name not in HF_COPIES:   # a GGUF file given by its path
        return None
    path = Path(os.environ.get("PEERS", os.path.expanduser("~/peers"))) / HF_COPIES[name]
    return str(path) if (path / "config.json").exists() else None


def model_file(name: str) -> str:
    from kvserve.model import default_model_path
    from kvserve.model.fetch import model_path
    if name not in MODELS:
        if not (name.endswith(".gguf") and os.path.isfile(name)):
            sys.exit(f"--models: {name!r} is neither one of {', '.join(MODELS)} nor a .gguf file")
        return name
    if MODELS[name] is None:
        return default_model_path()
    path = model_path(MODELS[name])
    if path is None:
        sys.exit(f"{name} is not fetched: run `make models`")
    return str(path)


def bf16_gguf(hf_dir: str, llama_bin: str) -> str:
    """The bf16 GGUF of an HF copy, converted by llama.cpp's convert_hf_to_gguf.py where not there yet."""
    out = Path(hf_dir).with_name(Path(hf_dir).name + "-bf16.gguf")
    if not out.exists():
        convert = Path(llama_bin).parents[1] / "convert_hf_to_gguf.py"   # build/bin -> the source tree
        if not convert.exists():
            sys.exit(f"--llama-file bf16: {convert} not found (make peers-llamacpp)")
        env = {**os.environ, "PYTHONPATH": str(convert.parent / "gguf-py")}
        part = out.with_suffix(".part")   # renamed once whole: an interrupted conversion leaves no GGUF behind
        proc = subprocess.run([sys.executable, str(convert), hf_dir, "--outtype", "bf16", "--outfile", str(part)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            part.unlink(missing_ok=True)
            sys.exit(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-3000:]}")
        os.replace(part, out)
    return str(out)


def peak_rss_mib(time_output: str) -> float:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_output)
    return int(m.group(1)) / 1024 if m else float("nan")


# run in the child: the engine, its resident set once started, then the latency loop
_CHILD = """
import json, sys
from kvserve.entrypoints.bench import main as bench_main
import kvserve.entrypoints.bench as b
orig = b._make_llm
def make(args):
    llm, load_s = orig(args)
    rss = int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) / 1024
    print(json.dumps({"rss_at_start_mib": rss, "weights": llm.llm_engine.weights_summary}), flush=True)
    return llm, load_s
b._make_llm = make
bench_main(sys.argv[1:])
"""


def run_kvserve(path: str, quantization: str, iters: int, dtype: str = "auto") -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = ["/usr/bin/time", "-v", sys.executable, "-c", _CHILD, "latency", "--model", path, "--quantization",
               quantization, "--dtype", dtype, "--kv-cache-memory", "256MiB", "--input-len", "256",
               "--output-len", "128",
               "--num-iters", str(iters), "--num-iters-warmup", "1", "--output-json", out.name]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"kvserve failed:\n{proc.stderr[-3000:]}")
        result = json.loads(Path(out.name).read_text())
    start = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"rss_at_start')))
    label = f"kvserve --quantization {quantization}" + ("" if dtype == "auto" else f" --dtype {dtype}")
    return {"engine": label, "tpot_ms": result["tpot_ms"]["mean"],
            "ttft_ms": result["ttft_ms"]["mean"], "dtype": result["dtype"], **start,
            "peak_rss_mib": peak_rss_mib(proc.stderr)}


def run_throughput(path: str, quantization: str, dtype: str = "auto", workload: str | None = None) -> dict:
    """`kvserve bench throughput` of 16 requests (prompts 64-256, outputs 32-128 tokens): its JSON result; the
    workload's token ids go to `workload` when given."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "kvserve", "bench", "throughput", "--model", path, "--quantization",
               quantization, "--dtype", dtype, "--kv-cache-memory", "512MiB", "--num-prompts", "16",
               "--input-len", "64:256",
               "--output-len", "32:128", "--no-tqdm", "--output-json", out.name]
        if workload:
            cmd += ["--save-workload", workload]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"kvserve bench throughput failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def run_vllm_throughput(hf_dir: str, workload: str) -> dict | None:
    """vLLM's CPU build (bf16) on the same workload, offline (benchmarks/compare.py's script); None without it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare import VLLM_ENV, VLLM_OFFLINE_SCRIPT, VLLM_PY
    if not VLLM_PY.exists():
        print(f"vLLM is not installed at {VLLM_PY.parent.parent} (make peers): skipped", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "vllm_generate.py", Path(tmp) / "vllm.json"
        script.write_text(VLLM_OFFLINE_SCRIPT)
        proc = subprocess.run([str(VLLM_PY), str(script), workload, hf_dir, str(out)], capture_output=True,
                              text=True, env={**os.environ, **VLLM_ENV})
        if proc.returncode != 0 or not out.exists():
            sys.exit(f"vLLM failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def run_llama_cpp(bin_dir: str, path: str, iters: int) -> dict:
    cmd = ["/usr/bin/time", "-v", os.path.join(bin_dir, "llama-bench"), "-m", path, "-p", "256", "-n", "128",
           "-t", "2", "-r", str(iters), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"llama-bench failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(proc.stdout)
    tg = next(r for r in rows if r["n_gen"] > 0)
    pp = next(r for r in rows if r["n_prompt"] > 0)
    return {"engine": "llama.cpp llama-bench", "tpot_ms": round(1000 / tg["avg_ts"], 2),
            "ttft_ms": round(1000 * 256 / pp["avg_ts"], 2), "peak_rss_mib": peak_rss_mib(proc.stderr)}


def merge_rounds(rows: list[dict]) -> dict:
    """One engine's rows of every round: the medians of its times, the largest of its memory figures."""
    out = dict(rows[0])
    for key in ("tpot_ms", "ttft_ms"):
        out[key] = round(statistics.median(r[key] for r in rows), 2)
    for key in ("peak_rss_mib", "rss_at_start_mib"):
        if key in out:
            out[key] = max(r[key] for r in rows)
    out["tpot_ms_per_round"] = [r["tpot_ms"] for r in rows]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2", "qwen1.5b"],
                   help=f"{', '.join(MODELS)}, or paths of GGUF files")
    p.add_argument("--llama-cpp", default=os.path.expanduser("~/peers/llama.cpp-src/build/bin"))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="run every engine this many times, in turn (medians)")
    p.add_argument("--configs", nargs="+", default=["gguf", "int8", "none"], choices=["gguf", "int8", "none"],
                   help="kvserve --quantization values to run (the first is the ratios' base)")
    p.add_argument("--throughput", action="store_true", help="also offline throughput per configuration")
    p.add_argument("--vllm", action="store_true", help="with --throughput: vLLM's CPU build (bf16) on the same "
                   "workload too (make peers; the bf16 HF copy of make hf-models)")
    p.add_argument("--dtypes", nargs="+", default=["auto"], help="run each configuration in each of these dtypes")
    p.add_argument("--llama-file", choices=["gguf", "bf16"], default="gguf",
                   help="llama.cpp's file: the model's GGUF, or the bf16 GGUF of its HF copy (make hf-models)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    results = {}
    for name in args.models:
        path = model_file(name)
        hf = hf_copy(name)
        sources = {q: hf if q != "gguf" and hf else path for q in args.configs}
        runs = [(q, dt) for q in args.configs for dt in args.dtypes]
        with_llama = os.path.exists(os.path.join(args.llama_cpp, "llama-bench"))
        llama_file = path
        if with_llama and args.llama_file == "bf16":
            if hf is None:
                sys.exit(f"--llama-file bf16: {name} has no HF copy (make hf-models)")
            llama_file = bf16_gguf(hf, args.llama_cpp)
        rounds = []   # every engine once per round: a machine whose speed drifts slows all of a round alike
        for _ in range(args.rounds):
            rows = [run_kvserve(sources[q], q, args.iters, dt) for q, dt in runs]
            if with_llama:
                rows.append({**run_llama_cpp(args.llama_cpp, llama_file, args.iters),
                             "checkpoint": "GGUF file" if llama_file == path else "bf16 GGUF of the HF copy"})
            rounds.append(rows)
        rows = [merge_rounds([r[i] for r in rounds]) for i in range(len(rounds[0]))]
        tmp = tempfile.TemporaryDirectory()
        workload = Path(tmp.name) / "workload.json"   # the first throughput run's, which vLLM runs
        for row, (q, dt) in zip(rows, runs):
            row["checkpoint"] = "bf16 HF copy" if sources[q] != path else "GGUF file"
            if args.throughput:
                save = str(workload) if not workload.exists() else None
                row["throughput_tok_s"] = round(run_throughput(sources[q], q, dt, save)["output_tokens_per_s"], 2)
        if args.vllm and not (args.throughput and hf and sources[runs[0][0]] == hf):
            print("--vllm: skipped (it needs --throughput, make hf-models, and a first configuration that loads the "
                  "bf16 HF copy, whose workload vLLM runs)", file=sys.stderr)
        elif args.vllm:
            v = run_vllm_throughput(hf, str(workload))
            if v is not None:
                rows.append({"engine": f"vLLM {v['version']} offline", "checkpoint": "bf16 HF copy",
                             "tpot_ms": None, "ttft_ms": None, "peak_rss_mib": None,
                             "throughput_tok_s": v["output_tokens_per_s"]})
        tmp.cleanup()
        results[name] = {"file": os.path.basename(path), "llama_cpp_file": os.path.basename(llama_file),
                         "rows": rows}
        base = rows[0]["tpot_ms"]
        print(f"\n{name} ({os.path.basename(path)})")
        if args.rounds > 1:
            ratios = [f"{r[-1]['tpot_ms'] / r[0]['tpot_ms']:.2f}" for r in rounds]
            print(f"  TPOT of {rounds[0][-1]['engine']} over {rounds[0][0]['engine']}'s, per round: {' '.join(ratios)}")
            results[name]["tpot_ratio_last_over_first_per_round"] = [float(x) for x in ratios]
        for r in rows:
            label = f"{r['engine']} ({r.get('checkpoint', 'GGUF file')})"
            if r["tpot_ms"] is None:   # vLLM: throughput only
                print(f"  {label:50s} throughput {r['throughput_tok_s']:7.1f} output tok/s")
                continue
            print(f"  {label:50s} TPOT {r['tpot_ms']:8.2f} ms ({r['tpot_ms'] / base:.2f}x)  TTFT "
                  f"{r['ttft_ms']:8.1f} ms  RSS at start {r.get('rss_at_start_mib', float('nan')):7.0f} MiB  "
                  f"peak {r['peak_rss_mib']:7.0f} MiB"
                  + (f"  throughput {r['throughput_tok_s']:7.1f} output tok/s" if "throughput_tok_s" in r else ""))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
