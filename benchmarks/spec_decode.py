"""Speculative decoding against none, every configuration side by side in one process (ratios against "off").

  python benchmarks/spec_decode.py [--only single,draft,batch] [--num-threads N]
                                   [--json benchmarks/results/spec_decode.json]

Sections (greedy throughout, prefix caching off so that every repeat does the same work):
  single  one request at a time on the bundled SmolLM2-135M: 3 copy-heavy chat prompts (edit a code snippet or a
          paragraph) and the first --single-copy-prompts (5) of the batch section's copy-heavy prompts (a few
          prompts make a fragile workload: a greedy token flipped by float rounding can turn an answer away from
          copying), max_tokens 128. Configurations: off, ngram k=5 (lookup 2-5) and k=7, suffix k=16 and k=8
          with the global tree off (suffix_max_cached_requests 0: the repeats send the same prompts, and a tree of
          earlier outputs would draft them from memory), and suffix k=16 with that tree (the repeat case, an upper
          bound); all with drafts sized by their match (max_spec_factor 1, the default), and ngram k=5 and
          suffix k=16 again "history-sized" (max_spec_factor null, adaptive_draft_length true: each draft as long
          as the last verification accepted plus one).
  draft   Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) with Qwen2.5-Coder-0.5B-Instruct as the draft model
          (`make models`; skipped without them): 2 code prompts, max_tokens 64. Configurations: off, draft k=3,
          draft k=5, draft k=3 with the file's Q8_0 head (draft_head_quantization null; the others requantize it
          to Q4_0, the default "auto"), draft k=3 with the file's layers (draft_quantization null: Q5_0, Q8_0,
          Q4_K and Q6_K; the others requantize all but the Q4_K ones to Q4_0, the default "auto"), draft k=3
          with the whole vocabulary (draft_vocab_size null; the others cut it to the first 32768 ids and each
          request's own ids past them, the default "auto"), ngram k=5; then off, draft k=3 and draft k=3 with
          the whole vocabulary on 2 Chinese prompts, whose text the cut leaves out. One engine holds both models
          and the configurations are switched on it between runs (switch_speculation), but for the file's head,
          the file's layers and the whole vocabulary, set at load: each gets an engine of its own. All
          sections run with --quantization (auto: the GGUFs stay quantized) and --dtype.
  batch   throughput of 64 concurrent requests (32 copy-heavy, 32 ordinary; max_tokens 64) on the bundled model:
          off, ngram k=5 with the default disable_by_batch_size (8) and ngram k=5 always on (None); then copy-heavy
          batches of 1-32 requests, off against ngram always on: the ratio per batch size places the threshold.
          Each repeat runs the configurations in turn, starting one further on each time (median of the repeats).

TPOT is decode time per output token: (time of generate with max_tokens=N - time with max_tokens=1, the prefill and
first token) / (output tokens - 1), the median over the repeats. Acceptance from the scheduler's spec_stats over the
timed runs: rate = accepted / drafted tokens, mean acceptance length = 1 + accepted / verify steps with drafts.
Every configuration's greedy tokens are checked against off's. Results go to --json (the sections not run are kept
from the file); a markdown table per section is printed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.config import QUANTIZATION_CHOICES

from spec_prompts import CHINESE_PROMPTS, DRAFT_PROMPTS, SINGLE_PROMPTS, copy_prompts, ordinary_prompts   # beside it

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("single", "draft", "batch")
NGRAM5 = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

# ----- measuring -----
def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def log(msg: str) -> None:
    print(f"[spec_decode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def chat_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def spec_counts(llm: LLM) -> dict:
    s = llm.llm_engine.scheduler.spec_stats
    return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens, "num_accepted_per_pos": list(s.num_accepted_per_pos)}


def add_counts(total: dict, before: dict, after: dict) -> None:
    """Add the counts between `before` and `after` into `total`."""
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        total[key] = total.get(key, 0) + after[key] - before[key]
    per_pos = total.setdefault("num_accepted_per_pos", [])
    for i, n in enumerate(after["num_accepted_per_pos"]):
        grown = n - (before["num_accepted_per_pos"][i] if i < len(before["num_accepted_per_pos"]) else 0)
        if i == len(per_pos):
            per_pos.append(0)
        per_pos[i] += grown


def acceptance(counts: dict) -> dict:
    """vLLM's figures: acceptance rate, mean acceptance length (tokens per verify step with drafts), per position."""
    drafts, drafted, accepted = counts.get("num_drafts", 0), counts.get("num_draft_tokens", 0), \
        counts.get("num_accepted_tokens", 0)
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_pos": [n / drafts for n in counts.get("num_accepted_per_pos", [])] if drafts else []}


def timed_generate(llm: LLM, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def decode_run(llm: LLM, prompt_ids: list[int], max_tokens: int, counts: dict) -> dict:
    """One TPOT sample: generate with max_tokens=1, then max_tokens; the drafts of the second added to `counts`."""
    t_first, _ = timed_generate(llm, [prompt_ids], greedy(1))
    before = spec_counts(llm)
    t_all, (tokens,) = timed_generate(llm, [prompt_ids], greedy(max_tokens))
    add_counts(counts, before, spec_counts(llm))
    return {"decode_s": t_all - t_first, "first_s": t_first, "num_output_tokens": len(tokens), "token_ids": tokens}


def first_difference(tok, ref: list[int], got: list[int]) -> dict | None:
    """Where `got` leaves the reference greedy output (None when they are equal)."""
    if ref == got:
        return None
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    piece = lambda ids: tok.decode(ids[i:i + 1]) if i < len(ids) else "<end>"
    return {"index": i, "off_token": ref[i] if i < len(ref) else None, "token": got[i] if i < len(got) else None,
            "off_text": piece(ref), "text": piece(got), "context": tok.decode(ref[max(0, i - 12):i]),
            "len_off": len(ref), "len": len(got)}


def make_llm(model: str | None, spec: dict | None, args, **kwargs) -> LLM:
    llm = LLM(model=model, speculative_config=spec, enable_prefix_caching=False, num_threads=args.num_threads,
              quantization=args.quantization, dtype=args.dtype, **kwargs)
    llm.generate([{"prompt_token_ids": chat_ids(llm, ["Say hello."])[0]}], greedy(8), use_tqdm=False)   # warm up
    return llm


def tpot_section(llms: dict, switch, prompts: list[list[int]], max_tokens: int, repeats: int, tok) -> dict:
    """TPOT of each configuration on each prompt, interleaved: for each repeat, for each prompt, every config."""
    samples = {name: [[] for _ in prompts] for name in llms}
    counts = {name: {} for name in llms}
    outputs = {name: [None] * len(prompts) for name in llms}
    for rep in range(repeats):
        for i, ids in enumerate(prompts):
            for name, llm in llms.items():
                switch(name)
                r = decode_run(llm, ids, max_tokens, counts[name])
                samples[name][i].append(r["decode_s"] / max(r["num_output_tokens"] - 1, 1))
                if rep == 0:
                    outputs[name][i] = r["token_ids"]
                elif outputs[name][i] != r["token_ids"]:
                    log(f"{name}: prompt {i} gave a different greedy output on repeat {rep + 1}")
                log(f"rep {rep + 1} prompt {i} {name:28s} TPOT {samples[name][i][-1] * 1e3:7.1f} ms, "
                    f"{r['num_output_tokens']} tokens (max_tokens=1: {r['first_s']:.2f} s), "
                    f"load {os.getloadavg()[0]:.2f}")
    rows = {}
    for name in llms:
        tpots = [statistics.median(s) for s in samples[name]]
        num_decode = [len(o) - 1 for o in outputs[name]]
        rows[name] = {"tpot_ms": 1e3 * sum(t * n for t, n in zip(tpots, num_decode)) / max(sum(num_decode), 1),
                      "tpot_ms_per_prompt": [1e3 * t for t in tpots], "tpot_ms_samples":
                          [[round(1e3 * x, 2) for x in s] for s in samples[name]],
                      "num_output_tokens": [len(o) for o in outputs[name]], **counts[name],
                      **acceptance(counts[name])}
    off = rows["off"]
    for name, row in rows.items():
        row["speedup"] = off["tpot_ms"] / row["tpot_ms"]
        row["speedup_per_prompt"] = [a / b for a, b in zip(off["tpot_ms_per_prompt"], row["tpot_ms_per_prompt"])]
        diffs = [first_difference(tok, ref, got) for ref, got in zip(outputs["off"], outputs[name])]
        row["outputs_equal_off"] = all(d is None for d in diffs)
        row["differences"] = {i: d for i, d in enumerate(diffs) if d is not None}
        if not row["outputs_equal_off"]:
            log(f"MISMATCH {name}: {row['differences']}")
    return rows


def tpot_table(rows: dict) -> list[str]:
    fmt = lambda x, spec: "—" if x is None else format(x, spec)
    lines = ["| config | TPOT ms | speedup | acceptance rate | mean acceptance length | per-prompt speedup | "
             "= off |", "|---|---:|---:|---:|---:|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tpot_ms']:.1f} | {r['speedup']:.2f}× | {fmt(r['acceptance_rate'], '.1%')} | "
                     f"{fmt(r['mean_acceptance_length'], '.2f')} | "
                     f"{' / '.join(f'{s:.2f}' for s in r['speedup_per_prompt'])} | "
                     f"{'yes' if r['outputs_equal_off'] else 'NO'} |")
    return lines


# ----- sections -----
def bench_single(args) -> tuple[dict, list[str]]:
    suffix = {"method": "suffix", "suffix_max_cached_requests": 0}
    by_history = {"max_spec_factor": None, "adaptive_draft_length": True}
    configs = {"off": None, "ngram k=5": NGRAM5,
               "ngram k=5, history-sized": {**NGRAM5, **by_history},
               "ngram k=7": {**NGRAM5, "num_speculative_tokens": 7},
               "suffix k=16": {**suffix, "num_speculative_tokens": 16},
               "suffix k=16, history-sized": {**suffix, "num_speculative_tokens": 16, **by_history},
               "suffix k=8": {**suffix, "num_speculative_tokens": 8},
               "suffix k=16, global tree": {"method": "suffix", "num_speculative_tokens": 16}}
    llms = {name: make_llm(None, spec, args, max_model_len=1024, kv_cache_memory="256MiB")
            for name, spec in configs.items()}
    tok = llms["off"].get_tokenizer()
    prompts = chat_ids(llms["off"], SINGLE_PROMPTS + copy_prompts()[:args.single_copy_prompts])
    rows = tpot_section(llms, lambda name: None, prompts, args.single_tokens, args.repeats, tok)
    res = {"model": "SmolLM2-135M-Instruct (bundled)", "dtype": str(llms["off"].llm_engine.dtype),
           "max_tokens": args.single_tokens, "repeats": args.repeats,
           "prompt_tokens": [len(p) for p in prompts], "configs": configs, "rows": rows}
    lines = [f"single stream, SmolLM2-135M, {len(prompts)} copy-heavy prompts "
             f"({'/'.join(map(str, res['prompt_tokens']))} tokens), max_tokens {args.single_tokens}, "
             f"median of {args.repeats}", "", *tpot_table(rows)]
    return res, lines


def switch_speculation(llm: LLM, spec: dict | None, draft_model) -> None:
    """Put one engine in another speculative configuration over the same loaded weights. The draft model runs in
    every step it is attached to, so configurations without it detach it; prefix caching is off, so no cached
    block lacks the draft's KV when it comes back."""
    from kvserve.spec_decode.config import SpeculativeConfig
    from kvserve.spec_decode.proposer import build_proposer
    engine = llm.llm_engine
    config = SpeculativeConfig.parse(spec)
    engine.spec_config = config
    engine.runner.draft_model = draft_model if config is not None and config.method == "draft_model" else None
    engine.proposer = build_proposer(config, engine.runner) if config is not None else None
    engine.scheduler.on_finished = engine.proposer.finish if engine.proposer is not None else None


def bench_draft(args) -> tuple[dict | None, list[str]]:
    from kvserve.model.fetch import model_path
    target, draft = model_path("qwen2.5-coder-1.5b"), model_path("qwen2.5-coder-0.5b")
    if target is None or draft is None:
        msg = "draft: skipped, the Qwen2.5-Coder GGUFs are not fetched (make models)"
        log(msg)
        return None, [msg]
    draft_spec = lambda k: {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    whole = "draft k=3, whole vocabulary"
    configs = {"off": None, "draft k=3": draft_spec(3), "draft k=5": draft_spec(5),
               "draft k=3, file's head": {**draft_spec(3), "draft_head_quantization": None},
               "draft k=3, file's layers": {**draft_spec(3), "draft_quantization": None},
               whole: {**draft_spec(3), "draft_vocab_size": None}, "ngram k=5": NGRAM5}
    t0 = time.perf_counter()
    llm = make_llm(str(target), draft_spec(5), args, max_model_len=1024, kv_cache_memory="256MiB")
    load_s = time.perf_counter() - t0
    draft_model = llm.llm_engine.runner.draft_model
    # a draft vocabulary cuts the draft's head at load, and the head and layers are requantized at load (to Q4_0
    # by default): those configurations get an engine of their own
    own = ("draft k=3, file's head", "draft k=3, file's layers", whole)
    llms = {name: llm for name in configs}
    for name in own:
        llms[name] = make_llm(str(target), configs[name], args, max_model_len=1024, kv_cache_memory="256MiB")
    prompts = chat_ids(llm, DRAFT_PROMPTS)

    def switch(name: str) -> None:
        if name not in own:
            switch_speculation(llm, configs[name], draft_model)

    rows = tpot_section(llms, switch, prompts, args.draft_tokens, args.draft_repeats, llm.get_tokenizer())
    # text the cut vocabulary leaves out: requests that draft from the whole one (DraftVocab.is_whole)
    chinese = chat_ids(llm, CHINESE_PROMPTS)
    zh_llms = {name: llms[name] for name in ("off", "draft k=3", whole)}
    zh_rows = tpot_section(zh_llms, switch, chinese, args.draft_tokens, args.draft_repeats, llm.get_tokenizer())
    switch_speculation(llm, draft_spec(5), draft_model)
    res = {"target": Path(target).name, "draft": Path(draft).name, "dtype": str(llm.llm_engine.dtype),
           "max_tokens": args.draft_tokens, "repeats": args.draft_repeats, "load_s": round(load_s, 1),
           "prompt_tokens": [len(p) for p in prompts], "configs": configs, "rows": rows,
           "chinese_prompt_tokens": [len(p) for p in chinese], "chinese_rows": zh_rows}
    title = (f"draft model, Qwen2.5-Coder-1.5B target / 0.5B draft ({res['dtype'].removeprefix('torch.')}), "
             f"max_tokens {args.draft_tokens}, median of {args.draft_repeats}")
    lines = [f"{title}, {len(prompts)} code prompts", "", *tpot_table(rows), "",
             f"{title}, {len(chinese)} Chinese prompts", "", *tpot_table(zh_rows)]
    return res, lines


def throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    elapsed, outs = timed_generate(llm, prompts, greedy(max_tokens))
    return sum(map(len, outs)) / elapsed, outs


def rotated(llms: dict, rep: int) -> list:
    """The configurations in turn, each repeat starting one further on: a machine drifting in speed over the run
    then favours none of them in the medians."""
    items = list(llms.items())
    return items[rep % len(items):] + items[:rep % len(items)]


def bench_batch(args) -> tuple[dict, list[str]]:
    configs = {"off": None, "ngram k=5": NGRAM5, "ngram k=5, always on": {**NGRAM5, "disable_by_batch_size": None}}
    llms = {name: make_llm(None, spec, args) for name, spec in configs.items()}
    tok = llms["off"].get_tokenizer()
    copy_ids, plain_ids = chat_ids(llms["off"], copy_prompts()), chat_ids(llms["off"], ordinary_prompts())
    mixed = [ids for pair in zip(copy_ids, plain_ids) for ids in pair]   # alternating, 64
    samples = {name: [] for name in configs}
    counts = {name: {} for name in configs}
    outs = {}
    for rep in range(args.batch_repeats):
        for name, llm in rotated(llms, rep):
            before = spec_counts(llm)
            tok_s, outs[name] = throughput(llm, mixed, args.batch_tokens)
            add_counts(counts[name], before, spec_counts(llm))
            samples[name].append(tok_s)
            log(f"rep {rep + 1} {len(mixed)} requests {name:22s} {tok_s:7.1f} output tok/s, "
                f"load {os.getloadavg()[0]:.2f}")
    rows = {}
    for name in configs:
        diffs = {i: d for i, (ref, got) in enumerate(zip(outs["off"], outs[name]))
                 if (d := first_difference(tok, ref, got)) is not None}
        rows[name] = {"output_tok_s": statistics.median(samples[name]), "samples": samples[name],
                      "num_output_tokens": sum(map(len, outs[name])), **counts[name], **acceptance(counts[name]),
                      "num_outputs_differing_from_off": len(diffs), "differences": diffs}
        rows[name]["ratio"] = rows[name]["output_tok_s"] / rows["off"]["output_tok_s"]
    # the sweep: copy-heavy batches, off against always on
    sweep_llms = {"off": llms["off"], "ngram k=5, always on": llms["ngram k=5, always on"]}
    del llms["ngram k=5"]
    gc.collect()
    sweep = {bs: {name: [] for name in sweep_llms} for bs in args.batch_sizes}
    sweep_equal, sweep_counts = {}, {bs: {} for bs in args.batch_sizes}
    always_on = sweep_llms["ngram k=5, always on"]
    for rep in range(args.batch_repeats):
        for bs in args.batch_sizes:
            got = {}
            before = spec_counts(always_on)
            for name, llm in rotated(sweep_llms, rep):
                tok_s, got[name] = throughput(llm, copy_ids[:bs], args.batch_tokens)
                sweep[bs][name].append(tok_s)
            add_counts(sweep_counts[bs], before, spec_counts(always_on))
            sweep_equal[bs] = got["off"] == got["ngram k=5, always on"]
            log(f"rep {rep + 1} batch {bs:2d}: off {sweep[bs]['off'][-1]:7.1f}, ngram always on "
                f"{sweep[bs]['ngram k=5, always on'][-1]:7.1f} output tok/s, load {os.getloadavg()[0]:.2f}")
    sweep_rows = {}
    for bs in args.batch_sizes:
        off, on = (statistics.median(sweep[bs][n]) for n in sweep_llms)
        sweep_rows[bs] = {"off_tok_s": off, "ngram_tok_s": on, "ratio": on / off, "samples": sweep[bs],
                          "outputs_equal_off": sweep_equal[bs], **sweep_counts[bs], **acceptance(sweep_counts[bs])}
    losing = [bs for bs in args.batch_sizes if sweep_rows[bs]["ratio"] < 1]
    threshold = max([bs for bs in args.batch_sizes if bs < min(losing)], default=None) if losing \
        else max(args.batch_sizes)
    res = {"model": "SmolLM2-135M-Instruct (bundled)", "dtype": str(llms["off"].llm_engine.dtype),
           "num_requests": len(mixed), "max_tokens": args.batch_tokens, "repeats": args.batch_repeats,
           "configs": configs, "rows": rows, "sweep": sweep_rows, "largest_batch_size_before_a_loss": threshold,
           "smallest_batch_size_losing": min(losing, default=None)}
    lines = [f"{len(mixed)} concurrent requests (32 copy-heavy, 32 ordinary), max_tokens {args.batch_tokens}, "
             f"median of {args.batch_repeats}", "",
             "| config | output tok/s | ratio | verify steps with drafts | acceptance rate | mean acceptance length "
             "| outputs ≠ off |", "|---|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x, spec: "—" if x is None else format(x, spec)
    for name, r in rows.items():
        lines.append(f"| {name} | {r['output_tok_s']:.1f} | {r['ratio']:.2f}× | {r.get('num_drafts', 0)} | "
                     f"{fmt(r['acceptance_rate'], '.1%')} | {fmt(r['mean_acceptance_length'], '.2f')} | "
                     f"{r['num_outputs_differing_from_off']} |")
    lines += ["", "copy-heavy batches, ngram k=5 always on against off (output tok/s)", "",
              "| batch size | off | ngram | ratio | acceptance rate | mean acceptance length | = off |",
              "|---:|---:|---:|---:|---:|---:|---|"]
    for bs, r in sweep_rows.items():
        lines.append(f"| {bs} | {r['off_tok_s']:.1f} | {r['ngram_tok_s']:.1f} | {r['ratio']:.2f}× | "
                     f"{fmt(r['acceptance_rate'], '.1%')} | {fmt(r['mean_acceptance_length'], '.2f')} | "
                     f"{'yes' if r['outputs_equal_off'] else 'NO'} |")
    first_loss = res["smallest_batch_size_losing"]
    lines += ["", f"ngram gains up to batch size {threshold}; "
              + (f"the first loss at {first_loss}" if first_loss else f"no loss up to {max(args.batch_sizes)}")
              + " (disable_by_batch_size, 8 by default: drafts while at most that many requests run)"]
    return res, lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: single,draft,batch")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads per engine (default: all cores)")
    p.add_argument("--repeats", type=int, default=3, help="single: runs per prompt and config (median)")
    p.add_argument("--single-tokens", type=int, default=128)
    p.add_argument("--single-copy-prompts", type=int, default=5,
                   help="single: how many of the batch section's copy-heavy prompts join its 3 own")
    p.add_argument("--draft-repeats", type=int, default=1)
    p.add_argument("--draft-tokens", type=int, default=64)
    p.add_argument("--batch-repeats", type=int, default=3)
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="weights: auto keeps a GGUF's quantization, none dequantizes it (the bundled model is a GGUF)")
    p.add_argument("--dtype", default="auto", help="activation dtype (auto: bf16 for quantized models where the "
                   "kernels' bf16 ops are vectorized, float32 otherwise)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "spec_decode.json"))
    args = p.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.exists() else {}
    report = []
    for section in (s for s in SECTIONS if s in only):
        load_before, t0 = load_avg(), time.perf_counter()
        res, lines = {"single": bench_single, "draft": bench_draft, "batch": bench_batch}[section](args)
        gc.collect()
        if res is not None:
            res.update({"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(),
                        "wall_s": round(time.perf_counter() - t0, 1), "load_before": load_before,
                        "load_after": load_avg(), "command": " ".join(["python", *sys.argv])})
            results[section] = res
            lines.append(f"\n{res['threads']} threads, {res['wall_s']:.0f} s, load average before / after: "
                         f"{' '.join(map(str, load_before))} / {' '.join(map(str, res['load_after']))}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1))   # after each section: a later failure keeps it
        report += ["", f"## {section}", "", *lines]
    print("\n".join(report))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
