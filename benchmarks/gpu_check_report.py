"""benchmarks/gpu_check.py's markdown table from its result (benchmarks/results/gpu_check.json's shape)."""
from __future__ import annotations


def async_cell(r: dict) -> str:
    """The decode step and TPOT with async scheduling on / off (graphs both), from the two runs of one engine."""
    if "decode64_graphs_other_scheduling_ms" not in r:
        return "not measured"
    on, off = ("graphs", "graphs_other_scheduling") if r.get("async_scheduling") else ("graphs_other_scheduling",
                                                                                       "graphs")
    return (f"{r[f'decode64_{on}_ms']} / {r[f'tpot_{on}_ms']} on, {r[f'decode64_{off}_ms']} / "
            f"{r[f'tpot_{off}_ms']} off")


def long_cell(r: dict) -> str:
    """Single-stream TPOT at ~2k tokens of context, split KV / not, and its bound."""
    if "tpot_long_split_ms" not in r or "tpot_long_unsplit_ms" not in r:
        return r.get("tpot_long_error", "not measured")
    return f"{r['tpot_long_split_ms']} / {r['tpot_long_unsplit_ms']} ({r['tpot_long_bound_ms']})"


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"GPU check on {env['gpu']} ({env.get('date', '')}): torch {env['torch']}, Triton {env['triton']}, "
             f"read bandwidth {env.get('read_bandwidth_gbs', '?')} GB/s (measured)", ""]
    t = result.get("tests", {})
    lines += [f"CUDA tests ({', '.join(t.get('files', []))}): {t.get('summary', 'not run')} "
              f"in {t.get('seconds', '?')} s", ""]
    if t.get("failures"):
        lines[-1:] = [f"- {f}" for f in t["failures"][:8]] + [""]
    lines += ["| model (random weights, bf16) | W1 kvserve s | W1 HF generate s | kvserve / HF | kvserve output tok/s "
              "| decode step b=64 ms, graphs / eager | its bound ms | graphs / bound | TPOT ms, graphs / eager "
              "| its bound ms | graphs / bound | graphs | async scheduling: decode b=64 / TPOT ms, on / off "
              "| TPOT at ~2k context ms, split KV / not (bound) | the forward's graph alone ms, b=64 / b=1 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("models", []):
        if "error" in r or "hf_s" not in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:160]} ||||||||||||||")
            continue
        lines.append(f"| {r['model']} | {r['kvserve_s']} | {r['hf_s']} | {r['speedup_vs_hf']}x | "
                     f"{r['kvserve_out_tok_s']} | {r['decode64_graphs_ms']} / {r['decode64_eager_ms']} | "
                     f"{r['decode64_bound_ms']} | {r['decode64_graphs_vs_bound']}x | {r['tpot_graphs_ms']} / "
                     f"{r['tpot_eager_ms']} | {r['tpot_bound_ms']} | {r['tpot_graphs_vs_bound']}x | {r['graphs']} | "
                     f"{async_cell(r)} | {long_cell(r)} | {r.get('decode64_graphs_replay_ms', '-')} / "
                     f"{r.get('tpot_graphs_replay_ms', '-')} |")
    return "\n".join(lines) + "\n"
