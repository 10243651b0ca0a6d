"""docs/benchmarks.md and its docs/bench_*.png plots from benchmarks/compare.py's results: the whole file is
generated; the optimization log, written by hand, is benchmarks/LOG.md.

  python benchmarks/compare_report.py [--no-plots]   # rewrite the report from benchmarks/results/compare.json
                                                     # without measuring (make bench measures, then does this)
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
LOG_POINTER = ("\n## The optimization log\n\nEach optimization's measurements, and what was tried and dropped, are in "
               "[benchmarks/LOG.md](../benchmarks/LOG.md).\n")
PLOTS = ("bench_offline.png", "bench_serving.png", "bench_concurrency.png", "bench_percentiles.png")
COLORS = {"transformers": "#999999", "vllm": "#6c8ebf", "kvserve": "#d6792c"}


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def plot(results: dict) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[dev]'): no plots")
        return []
    made = []
    offline = results.get("offline", {})
    if offline:
        names = [n for n in ("transformers", "vllm", "kvserve") if offline.get(n)]
        vals = [offline[n]["output_tokens_per_s"] for n in names]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        bars = ax.barh(names, vals, color=[COLORS[n] for n in names])
        ax.bar_label(bars, fmt="%.0f")
        ax.set_xlabel("output tokens/s (higher is better)")
        cores = re.search(r"(\d+) cores", results["machine"])   # the measuring machine's, not this one's
        ax.set_title(f"W1 offline: {results['num_prompts']} requests, SmolLM2-135M"
                     + (f", {cores[1]} CPU cores" if cores else ""))
        fig.tight_layout()
        fig.savefig(DOCS / "bench_offline.png", dpi=110)
        plt.close(fig)
        made.append("bench_offline.png")
    serve = results.get("serve", {})
    rows = [(n, serve[n]) for n in ("vllm", "kvserve") if serve.get(n) and serve[n].get("s1")]
    if rows:
        fig, axes = plt.subplots(1, 3, figsize=(10, 3))
        for ax, key, label in zip(axes, ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"),
                                  ("S1 output tok/s (higher better)", "S1 mean TTFT ms (lower better)",
                                   "S1 mean TPOT ms (lower better)")):
            bars = ax.bar([n for n, _ in rows], [r["s1"][key] for _, r in rows], color=[COLORS[n] for n, _ in rows])
            ax.bar_label(bars, fmt="%.0f")
            ax.set_title(label, fontsize=9)
        fig.tight_layout()
        fig.savefig(DOCS / "bench_serving.png", dpi=110)
        plt.close(fig)
        made.append("bench_serving.png")
        made += _plot_concurrency(plt, serve) + _plot_percentiles(plt, serve)
    return made


def concurrency_points(r: dict) -> list[tuple[int, dict]]:
    """(concurrency, bench figures) of one engine: the single stream, the sweep, S1 as 64."""
    pts = [(1, r.get("single_stream"))] + [(int(c), v) for c, v in (r.get("sweep") or {}).items()]
    pts.append((64, r.get("s1")))
    return sorted((c, v) for c, v in pts if v)


def _plot_concurrency(plt, serve: dict) -> list[str]:
    engines = [n for n in ("vllm", "kvserve") if serve.get(n) and serve[n].get("sweep")]
    if not engines:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for name in engines:
        pts = concurrency_points(serve[name])
        xs = [c for c, _ in pts]
        axes[0].plot(xs, [v["output_throughput"] for _, v in pts], "o-", color=COLORS[name], label=name)
        axes[1].plot(xs, [v["median_tpot_ms"] for _, v in pts], "o-", color=COLORS[name], label=name)
    for ax, title in zip(axes, ("output tok/s (higher is better)", "median TPOT ms (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 16, 64], ["1", "4", "16", "64"])
        ax.set_xlabel("concurrent requests (256 in / 128 out)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "bench_concurrency.png", dpi=110)
    plt.close(fig)
    return ["bench_concurrency.png"]


def _plot_percentiles(plt, serve: dict) -> list[str]:
    engines = [n for n in ("vllm", "kvserve") if serve.get(n) and serve[n].get("s1")]
    if not engines:
        return []
    panels = [("s1", "ttft", "S1 TTFT ms"), ("s1", "tpot", "S1 TPOT ms"), ("single_stream", "ttft", "1-stream TTFT ms"),
              ("single_stream", "tpot", "1-stream TPOT ms")]
    fig, axes = plt.subplots(1, 4, figsize=(12, 3))
    for ax, (run, metric, title) in zip(axes, panels):
        for i, name in enumerate(engines):
            r = serve[name].get(run) or {}
            vals = [r.get(f"{k}_{metric}_ms") or 0 for k in ("median", "p99")]
            bars = ax.bar([j + 0.38 * i for j in range(2)], vals, width=0.36, color=COLORS[name], label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks([0.19, 1.19], ["p50", "p99"])
        ax.set_title(title + " (lower is better)", fontsize=8)
        ax.legend(fontsize=7, loc="lower center")
    fig.tight_layout()
    fig.savefig(DOCS / "bench_percentiles.png", dpi=110)
    plt.close(fig)
    return ["bench_percentiles.png"]


def fmt(x, spec=".1f") -> str:
    return "—" if x is None else format(x, spec)


def ratio(a, b) -> str:
    return "—" if not a or not b else f"{a / b:.2f}×"


INTRO = """\
kvserve against vLLM's CPU build and Hugging Face transformers on the CPU, with the bundled
SmolLM2-135M-Instruct (bf16; transformers in float32). `make peers` installs the peers
(benchmarks/peers/README.md); `make bench` (benchmarks/compare.py) measures them one after another and
rewrites this file and the plots. Every engine gets the same token ids.
"""

WORKLOADS = """\
## Workloads

- **W1 offline**: N random-token prompts of 64–512 tokens, 32–256 output tokens each, greedy, `ignore_eos`,
  seed 0, all submitted at once (vLLM's and kvserve's `LLM.generate`; transformers' `model.generate` over
  static left-padded batches of 16).
- **S1 serving burst**: `vllm bench serve`, random 256 in / 128 out, 64 requests at once; `--s1-runs` runs per
  engine (3 by default) with new prompts (no prefix-cache hits), the run with the median output throughput
  reported.
- **Single stream**: the same client with `--max-concurrency 1`, 8 requests.
- **Concurrency sweep**: `--max-concurrency C` with 2C requests for C = 4 and 16 (1 is the single stream,
  64 is S1).
- **Start-up**: seconds from launching the server until it has answered its first request.
"""

READING = """\
## Reading the figures

The machine is small and shared: with two OpenMP threads on two cores, any other process that takes a core
stalls every parallel region, so absolute figures move between runs minutes apart, and the peers' with them.
Read each figure with the load average above; compare engines by the ratios, which are taken side by side in
one run. The same holds for the scripts below: each measures its configurations interleaved in one process.
"""

COMMANDS = """\
## Commands

| command | what |
|---|---|
| `make bench` (= `python benchmarks/compare.py`) | everything above, for kvserve and every installed peer; rewrites this file and `docs/bench_*.png` |
| `python benchmarks/compare.py --only offline --skip-hf` | W1 only, kvserve and vLLM (`--only serve`: the serving part; the other part of the report is kept) |
| `python benchmarks/compare_report.py` | this file and the plots again from `benchmarks/results/compare.json`, without measuring |
| `python benchmarks/ablation.py --num-prompts 8 --num-threads 1` | each optimization switched on in turn, side by side in one process (W1-style throughput; `--single-stream`: one request's TPOT) |
| `python benchmarks/attention_kernel.py [--num-threads N] [--layers 30]` | the bf16 attention kernel over the tiled KV layout against the AVX-512 kernel over the standard layout and the torch backend, on W1-shaped decode and prefill steps and one sequence verifying 5 drafts, K/V from DRAM (30 layers' pools) or caches (`--layers 1`) |
| `python benchmarks/matmul.py [--num-threads N] [--rows ...]` | the C++ bf16 matmuls (GEMV, register-tiled GEMM) against oneDNN's packed path for steps of M rows, layer weights and LM head |
| `python benchmarks/int8_matmul.py [--rows ...] [--num-threads N]` | `--quantization int8`'s matmul (INT8) against the Q8_0 kernels and the dense linear this CPU would run, on Qwen2.5-Coder-1.5B's MLP shapes, for steps of M rows |
| `python benchmarks/load_memory.py [MODEL] [--kv-cache-memory 256MiB]` | the resident set sampled every 50 ms while an engine starts: its peak (a load's), where it ends, and what the engine added to the runtime's against the model's files |
| `python benchmarks/quant_ab.py DIR_A DIR_B [--rows ...] [--copies N] [--weights ...]` | two builds of the quantized matmul kernels (two copies of `kvserve/csrc`, e.g. a worktree of the commit before) alternating in one process on real GGUF tensors, streamed from memory or in cache: the A/B behind kernel changes |
| `python benchmarks/attention_ab.py DIR_A DIR_B [--variant no-avx512] [--layout tiled] [--heads 4 --kv-heads 1 --head-dim 256]` | two builds of the C++ attention kernels (two copies of `kvserve/csrc`) alternating in one process on one attention shape's decode steps (one sequence at 1,000 to 16,000 keys, two, a batch of 64) and a prefill, K/V from DRAM: the A/B behind attention kernel changes |
| `python benchmarks/widen_gemm_ab.py DIR_A DIR_B [--variant no-avx512bf16]` | two builds of the matmul that widens bf16 weights (two copies of `kvserve/csrc`) alternating in one process on a pass over the bundled model's 30 layers, W from DRAM: the A/B behind its changes |
| `python benchmarks/bf16_accuracy.py` | bf16 against float32 with each kernel switched in or out (teacher-forced top-1 agreement and logprob error) |
| `python benchmarks/quantization.py [--models smollm2 qwen1.5b] [--throughput --vllm]` | GGUF kept quantized, int8 and FP8 KV against the dequantized model, llama.cpp and vLLM: TPOT, TTFT, memory, throughput |
| `python benchmarks/spec_decode.py [--only single,draft,batch]` | speculative decoding (n-gram, suffix, draft model) against none, side by side in one process |
| `python benchmarks/spec_sampled.py [--temperatures 0.5,1.0]` | random sampling with a draft model: drafts drawn from the draft's distribution against its argmax, and against none |
| `python benchmarks/sampling.py` | the cost of random sampling: temperature 1 against greedy, one request and 64 concurrent |
| `python benchmarks/step_overhead.py [--baseline DIR]` | the host's share of a decode step at batch 64 (scheduling, inputs, sampling, outputs) on a one-layer model with the bundled vocabulary, against another checkout's, alternating |
| `python benchmarks/bf16_matmul_avx2.py [no-avx512bf16]` | the packed matmul that widens bf16 weights (what AVX2 CPUs, and AVX-512 ones without BF16, run) against oneDNN's float32 one, by rows (run under `ONEDNN_MAX_CPU_ISA=AVX2` or `AVX512_CORE_VNNI`) |
| `python benchmarks/w1_peers.py [--isa native\|avx2] [--rounds 2]` | W1 for kvserve's dense bf16 path and `--quantization int8` against vLLM's CPU build in float32 and bfloat16, alternating; `--isa avx2`: every engine held to AVX2 |
| `make gpu-check` (on an NVIDIA GPU machine) | the CUDA tests, then W1 against transformers' `generate`, the decode step at batch 64 and single-stream TPOT with and without CUDA graphs, and with async scheduling on and off, against the bandwidth bound (docs/gpu.md) |
| `make gpu-check-model` (right after `make gpu-check`, on the same machine) | the bundled model's real weights greedy on CUDA in float32 against transformers (its file carried in two calls: docs/gpu.md) |
| `make gpu-compile` | every Triton kernel variant compiled for sm_80 and sm_90 without a GPU: registers, spills, shared memory |
| `python benchmarks/fp8_kv.py`, `lora.py`, `distributed.py`, `structured_outputs.py`, `kernel_paths.py`, `float32_packing.py` | FP8 KV, multi-LoRA, tensor parallelism and replicas, grammars, each kernel path, float32 packing: each against its baseline in one run (the script's docstring says how) |
| `python benchmarks/prefix_caching.py --json benchmarks/results/prefix_caching.json` | prefix caching on against off |
| `kvserve bench throughput --num-prompts 64 --input-len 64:512 --output-len 32:256 --dtype bfloat16` | W1 for kvserve alone (`--output-json`) |
| `kvserve bench latency --input-len 256 --output-len 128 --num-iters 8` | TTFT / TPOT percentiles of one request at a time |
| `kvserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 [--max-concurrency C] [--request-rate R]` | the built-in serving client for any OpenAI-compatible server: `vllm bench serve`'s random workload (256 in / 128 out, token-id prompts, streaming, greedy, `ignore_eos`) and metric names. The same `--seed` sends the same prompts, so a second run hits the server's prefix cache: change the seed between runs (compare.py does) |
"""


def runs(results: dict) -> str:
    """Which command measured the report's parts, and when (with --only, the parts come from different runs)."""
    made = results.get("provenance") or {"all": {"command": "python benchmarks/compare.py", "date": results["date"]}}

    def say(m: dict) -> str:
        cmd = "`make bench`" if m["command"] == "python benchmarks/compare.py" else f"`{m['command']}`"
        return f"{cmd} on {m['date']}"
    if len({(m["command"], m["date"]) for m in made.values()}) == 1:
        return "Measured by " + say(next(iter(made.values()))) + "."
    return "Measured by " + "; ".join(f"{say(m)} ({part})" for part, m in made.items()) + "."


def header(results: dict) -> list[str]:
    return ["# Benchmarks", "",
            "<!-- Generated by benchmarks/compare_report.py from benchmarks/results/compare.json: change the "
            "generator, not this text; the optimization log is benchmarks/LOG.md. -->", "",
            INTRO, f"- Machine: {results['machine']}; load average before / after: {results['load_before']} / "
            f"{results['load_after']}.",
            "- Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".",
            f"- {runs(results)}", ""]


def summary(results: dict) -> list[str]:
    off, serve = results.get("offline") or {}, results.get("serve") or {}
    kv_s, vl_s = serve.get("kvserve") or {}, serve.get("vllm") or {}
    rows = [("W1 output tok/s (higher is better)", lambda e: (off.get(e) or {}).get("output_tokens_per_s"), ".1f"),
            ("S1 output tok/s (higher is better)", lambda e: _s1(serve, e, "output_throughput"), ".1f"),
            ("S1 mean TTFT ms (lower is better)", lambda e: _s1(serve, e, "mean_ttft_ms"), ".0f"),
            ("single-stream mean TPOT ms (lower is better)", lambda e: _ss(serve, e, "mean_tpot_ms"), ".1f"),
            ("single-stream mean TTFT ms (lower is better)", lambda e: _ss(serve, e, "mean_ttft_ms"), ".0f"),
            ("start-up s (lower is better)", lambda e: (serve.get(e) or {}).get("startup_s"), ".1f")]
    if not (off.get("vllm") or (kv_s and vl_s)):
        return []
    lines = ["## Summary: kvserve against vLLM", "", "| figure | kvserve | vLLM | kvserve / vLLM |",
             "|---|---:|---:|---:|"]
    for label, get, spec in rows:
        kv, vl = get("kvserve"), get("vllm")
        if kv is not None or vl is not None:
            lines.append(f"| {label} | {fmt(kv, spec)} | {fmt(vl, spec)} | {ratio(kv, vl)} |")
    return lines + [""]


def _s1(serve: dict, engine: str, key: str):
    return ((serve.get(engine) or {}).get("s1") or {}).get(key)


def _ss(serve: dict, engine: str, key: str):
    return ((serve.get(engine) or {}).get("single_stream") or {}).get(key)


def offline_table(results: dict) -> list[str]:
    off = results.get("offline") or {}
    if not off:
        return []
    kv = (off.get("kvserve") or {}).get("output_tokens_per_s")
    lines = [f"## W1 offline ({results['num_prompts']} requests, 64–512 in, 32–256 out, greedy, ignore_eos)", "",
             "| engine | dtype | output tok/s | total tok/s | req/s | kvserve is |", "|---|---|---:|---:|---:|---:|"]
    for name in ("kvserve", "vllm", "transformers"):
        r = off.get(name)
        if r:
            lines.append(f"| {name} | {r.get('dtype', '')} | {fmt(r['output_tokens_per_s'])} | "
                         f"{fmt(r['total_tokens_per_s'])} | {fmt(r['requests_per_s'], '.2f')} | "
                         f"{'—' if name == 'kvserve' else ratio(kv, r['output_tokens_per_s'])} |")
        else:
            lines.append(f"| {name} | | not run | | | |")
    lines.append("")
    if off.get("transformers"):
        lines += ["transformers runs static batches of 16 until each batch's longest request is done; only the "
                  "requested tokens are counted.", ""]
    return lines


def serving_tables(results: dict) -> list[str]:
    serve = results.get("serve") or {}
    if not serve:
        return []
    lines = ["## Serving (`vllm bench serve` client, random 256 in / 128 out, ignore_eos)", "",
             "| engine | start-up s | S1 output tok/s | S1 mean TTFT ms | S1 mean TPOT ms | 1-stream TTFT ms | "
             "1-stream TPOT ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in ("kvserve", "vllm"):
        r = serve.get(name)
        if not r:
            lines.append(f"| {name} | not run | | | | | |")
            continue
        s1, ss = r.get("s1") or {}, r.get("single_stream") or {}
        lines.append(f"| {name} | {fmt(r['startup_s'])} | {fmt(s1.get('output_throughput'))} | "
                     f"{fmt(s1.get('mean_ttft_ms'), '.0f')} | {fmt(s1.get('mean_tpot_ms'))} | "
                     f"{fmt(ss.get('mean_ttft_ms'), '.0f')} | {fmt(ss.get('mean_tpot_ms'))} |")
    lines.append("")
    runs = {n: serve[n].get("s1_runs") for n in ("kvserve", "vllm") if serve.get(n) and serve[n].get("s1_runs")}
    if runs:
        lines += ["S1 is the run with the median output throughput of each engine's runs; output tok/s / mean TTFT s "
                  "of every run: " + "; ".join(
                      f"{n} " + ", ".join(f"{fmt(r['output_throughput'])} / {r['mean_ttft_ms'] / 1e3:.2f}" for r in rs)
                      for n, rs in runs.items()) + ".", ""]
    return lines + sweep_table(serve)


def sweep_table(serve: dict) -> list[str]:
    if not any(r.get("sweep") for r in serve.values() if r):
        return []
    lines = ["Output tok/s (median TPOT ms) against concurrency (`--max-concurrency C`, 2C requests; 64 = S1):", "",
             "| engine | 1 | 4 | 16 | 64 |", "|---|---:|---:|---:|---:|"]
    for name in ("kvserve", "vllm"):
        if serve.get(name):
            by_c = dict(concurrency_points(serve[name]))
            cells = [f"{fmt(by_c[c]['output_throughput'])} ({fmt(by_c[c]['median_tpot_ms'])})" if c in by_c else "–"
                     for c in (1, 4, 16, 64)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def prefix_caching_table(path: Path = RESULTS / "prefix_caching.json") -> list[str]:
    """The last `benchmarks/prefix_caching.py --json` results, when there are some."""
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    t, m, tp = r["ttft"], r["memory"], r["throughput"]
    when = f", {r['date']}" if r.get("date") else ""
    how_many = f"{tp['requests']} " if tp.get("requests") else ""   # results from before the count was saved
    return [f"## Prefix caching (`benchmarks/prefix_caching.py`, {r['dtype'].removeprefix('torch.')}{when})", "",
            "Side by side in one process (results in `benchmarks/results/prefix_caching.json`):", "",
            "| what | cached / shared | not | ratio |", "|---|---:|---:|---:|",
            f"| TTFT, {r['system_len']}-token system prompt + question (median of 5; miss = fresh `cache_salt`) | "
            f"{t['ttft_cached_s'] * 1e3:.0f} ms | {t['ttft_uncached_s'] * 1e3:,.0f} ms | "
            f"**{t['speedup']:.0f}×** faster |",
            f"| peak KV blocks for `n = {m['n']}` samples of that prompt, 32 tokens each | {m['blocks_shared']} | "
            f"{m['blocks_unshared']} ({m['n']} separate requests, caching off) | **{m['ratio']:.0f}×** fewer |",
            f"| throughput, {how_many}requests sharing the system prompt, "
            f"32 tokens each | {tp['tok_s_on']:.0f} tok/s | {tp['tok_s_off']:.0f} tok/s | **{tp['ratio']:.1f}×** |", "",
            "With sharing, the samples hold one copy of the prompt's blocks plus their own tail and output blocks.", ""]


def w1_peers_section() -> list[str]:
    """The last `benchmarks/w1_peers.py` run of each ISA: W1 for kvserve's dense and int8 paths against each of vLLM's
    dtypes."""
    lines = []
    for path in sorted(RESULTS.glob("w1_peers_*.json")):
        r = json.loads(path.read_text())
        how = (" Every engine ran as on an AVX2 CPU: kvserve's kernels, oneDNN and ATen held to AVX2 (vLLM's own "
               "kernels may still use AVX-512).") if r["isa"] == "avx2" else ""
        kind = "as AVX2" if r["isa"] == "avx2" else r.get("kind", "AVX-512 BF16")   # before "kind": that machine's
        kind += " only" if kind == "AVX2" else ""
        lines += [f"## W1 against vLLM's dtypes: {r['cpu']}, {kind}", "",
                  f"`python benchmarks/w1_peers.py --isa {r['isa']}` ({r['date']}, load average {r['load_avg']}): "
                  f"W1 ({r['num_prompts']} requests), the engines alternating over {r['rounds']} rounds, output tok/s "
                  f"(results in `benchmarks/results/{path.name}`).{how}", "",
                  "| engine | output tok/s, each run | median | / vLLM's best dtype |", "|---|---|---:|---:|"]
        for row in r["rows"]:
            runs = ", ".join(f"{v:.1f}" for v in row["output_tok_s"]) or "failed"
            median = f"{row['median']:.1f}" if row["median"] else "-"
            ratio = f"{row['vs_best_vllm']:.2f}×" if row["vs_best_vllm"] else "-"
            lines.append(f"| {row['engine']} | {runs} | {median} | {ratio} |")
        lines.append("")
    return lines


def measured_sections() -> list[str]:
    """Sections written by hand from a script's run (each names its command and date), kept as they are:
    benchmarks/results/section_*.md, in the order of their names."""
    return [path.read_text().strip() + "\n" for path in sorted(RESULTS.glob("section_*.md"))]


def gpu_section(path: Path = RESULTS / "gpu_check.md") -> list[str]:
    """The last GPU check's table (`make gpu-check` on a machine with an NVIDIA GPU; docs/gpu.md), when there is one."""
    if not path.exists():
        return []
    gpu = json.loads(path.with_suffix(".json").read_text())["env"]["gpu"]
    return [f"## GPU: {gpu}", "",
            "`make gpu-check` (benchmarks/gpu_check.py, docs/gpu.md): the CUDA tests, then W1 against transformers' "
            "`generate` on the same GPU (one left-padded batch of 64; both credited only the tokens asked for), and "
            "the decode step at batch 64 and single-stream TPOT against the time to read the weights and the "
            "attended KV once at the measured bandwidth. Random weights in the real models' shapes, bf16 "
            "(results in `benchmarks/results/gpu_check.json`).", "", path.read_text().strip(), ""]


def report(results: dict, plots: list[str]) -> str:
    """The generated part of docs/benchmarks.md: everything above the optimization log."""
    lines = header(results) + summary(results) + [WORKLOADS] + offline_table(results) + serving_tables(results)
    lines += [f"![{p}]({p})" for p in plots] + ([""] if plots else [])
    lines += prefix_caching_table() + w1_peers_section() + measured_sections() + gpu_section() + [READING, COMMANDS]
    return "\n".join(lines)


def write_doc(generated: str, path: Path = DOCS / "benchmarks.md") -> None:
    """Write the generated report and its pointer to the optimization log (benchmarks/LOG.md, written by hand)."""
    path.write_text(generated.rstrip("\n") + "\n" + LOG_POINTER)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS / "compare.json")
    p.add_argument("--no-plots", action="store_true", help="link the plots already in docs/ instead of redrawing")
    args = p.parse_args()
    results = json.loads(args.results.read_text())
    plots = ([n for n in PLOTS if (DOCS / n).exists()] if args.no_plots else plot(results))
    write_doc(report(results, plots))
    log(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
