"""Tables and plots of benchmarks/compare.py's results: the generated section of docs/benchmarks.md and the
docs/bench_*.png figures (W1 bars, S1 bars, throughput and TPOT against concurrency, latency percentiles)."""
from __future__ import annotations

import os
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
BEGIN, END = "<!-- compare.py:begin -->", "<!-- compare.py:end -->"
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
        ax.set_title(f"W1 offline: {results['num_prompts']} requests, SmolLM2-135M, {os.cpu_count()} CPU cores")
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


def report(results: dict, plots: list[str]) -> str:
    lines = [f"_Generated by `make bench` (benchmarks/compare.py) on {results['date']}; machine: {results['machine']}; "
             f"load average before/after: {results['load_before']} / {results['load_after']}._", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), ""]
    off = results.get("offline", {})
    if off:
        kv = (off.get("kvserve") or {}).get("output_tokens_per_s")
        lines += [f"### W1 offline ({results['num_prompts']} requests, 64–512 in, 32–256 out, greedy, ignore_eos)", "",
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
    serve = results.get("serve", {})
    if serve:
        lines += ["### Serving (`vllm bench serve` client, random 256 in / 128 out, ignore_eos)", "",
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
            lines.append("S1 is the run with the median output throughput of each engine's runs (new prompts each), "
                         "output tok/s / mean TTFT s per run: " + "; ".join(
                             f"{n} " + ", ".join(f"{fmt(r['output_throughput'])} / {r['mean_ttft_ms'] / 1e3:.2f}"
                                                  for r in rs) for n, rs in runs.items()) + ".")
            lines.append("")
        sweep_rows = [(n, concurrency_points(serve[n])) for n in ("kvserve", "vllm") if serve.get(n)]
        if any(r.get("sweep") for r in serve.values() if r):
            lines += ["Output tok/s (median TPOT ms) against concurrency (`--max-concurrency C`, 2C requests; 64 = S1):", "",
                      "| engine | 1 | 4 | 16 | 64 |", "|---|---:|---:|---:|---:|"]
            for name, pts in sweep_rows:
                by_c = dict(pts)
                cells = [f"{fmt(by_c[c]['output_throughput'])} ({fmt(by_c[c]['median_tpot_ms'])})" if c in by_c else "–"
                         for c in (1, 4, 16, 64)]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_doc(section: str) -> None:
    path = DOCS / "benchmarks.md"
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1] if END in rest else ""
    path.write_text(f"{head}{BEGIN}\n{section}{END}{tail}")


