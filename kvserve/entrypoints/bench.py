"""`kvserve bench throughput|latency|serve`: benchmarks with vLLM's flag names.

throughput: N random-token prompts with random input/output lengths, all submitted at once (greedy,
ignore_eos), like `vllm bench throughput --dataset-name random`; prints requests/s and tokens/s.
latency: one request at a time, repeated; prints TTFT and TPOT percentiles.
serve: a client for a running server (kvserve/entrypoints/bench_serve.py).
Without the CLI: `python -m kvserve.entrypoints.bench throughput --num-prompts 64 ...`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvserve.config import KV_CACHE_DTYPES, QUANTIZATION_CHOICES

DEFAULT_INPUT_LEN = "64:512"
DEFAULT_OUTPUT_LEN = "32:256"


def parse_range(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B) inclusive; 'N' -> (N, N)."""
    lo, _, hi = str(text).partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or A:B, got {text!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text!r}")
    return lo_i, hi_i


def random_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                    vocab_size: int, special_ids=()) -> list[dict]:
    """[{prompt_token_ids, output_len}] drawn from one seeded generator; special tokens are never drawn.

    The same arguments give the same workload on every engine (benchmarks/compare.py feeds it to the peers)."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))
    in_lens = rng.integers(input_len[0], input_len[1] + 1, num_prompts)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, num_prompts)
    return [{"prompt_token_ids": rng.choice(allowed, int(n)).tolist(), "output_len": int(m)}
            for n, m in zip(in_lens, out_lens)]


def _engine_kwargs(args) -> dict:
    kw = {"dtype": args.dtype, "seed": args.seed}
    for name in ("model", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_threads", "quantization",
                 "kv_cache_memory", "kv_cache_dtype", "calculate_kv_scales"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if getattr(args, "no_prefix_caching", False):
        kw["enable_prefix_caching"] = False
    return kw


def _make_llm(args):
    from kvserve import LLM
    t0 = time.perf_counter()
    llm = LLM(**_engine_kwargs(args))
    return llm, time.perf_counter() - t0


def _special_ids(tokenizer) -> list[int]:
    return sorted(set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {}))


def run_throughput(args) -> dict:
    """Generate for the whole workload at once; returns the figures (also printed)."""
    from kvserve import SamplingParams
    llm, load_s = _make_llm(args)
    engine = llm.llm_engine
    work = random_workload(args.num_prompts, args.input_len, args.output_len, args.seed, engine.vocab_size,
                           _special_ids(engine.tokenizer))
    if args.save_workload:
        Path(args.save_workload).write_text(json.dumps(work))
    if args.warmup:
        llm.generate([{"prompt_token_ids": work[0]["prompt_token_ids"][:32]}],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in work]
    params = [SamplingParams(temperature=0, max_tokens=w["output_len"], ignore_eos=True,
                             detokenize=not args.disable_detokenize) for w in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    elapsed = time.perf_counter() - t0
    num_in = sum(len(o.prompt_token_ids) for o in outs)
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    expected = sum(w["output_len"] for w in work)
    result = {
        "engine": "kvserve", "dtype": str(engine.dtype).removeprefix("torch."), "num_requests": len(outs),
        "num_input_tokens": num_in, "num_output_tokens": num_out, "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(outs) / elapsed, 3), "output_tokens_per_s": round(num_out / elapsed, 2),
        "total_tokens_per_s": round((num_in + num_out) / elapsed, 2), "load_s": round(load_s, 2),
        "max_num_seqs": engine.config.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
    }
    if num_out != expected:
        print(f"warning: generated {num_out} tokens, the workload asked for {expected}", file=sys.stderr)
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.1f} total tokens/s, "
          f"{result['output_tokens_per_s']:.1f} output tokens/s  ({num_out} output tokens in {elapsed:.1f} s)")
    if args.output_tokens:
        with open(args.output_tokens, "w") as f:
            json.dump([o.outputs[0].token_ids for o in outs], f)
    _write_json(args, result)
    return result


def run_latency(args) -> dict:
    """One request at a time, `num_iters` times after `num_iters_warmup`; TTFT/TPOT percentiles in ms."""
    from kvserve import SamplingParams
    from kvserve.sampling_params import RequestOutputKind
    llm, load_s = _make_llm(args)
    engine = llm.llm_engine
    work = random_workload(args.num_iters_warmup + args.num_iters, (args.input_len,) * 2, (args.output_len,) * 2,
                           args.seed, engine.vocab_size, _special_ids(engine.tokenizer))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ttfts, tpots, e2es = [], [], []
    for i, w in enumerate(work):
        if not args.prefix_cache_hits:
            engine.reset_prefix_cache()
        t0 = time.perf_counter()
        engine.add_request(None, {"prompt_token_ids": w["prompt_token_ids"]}, params)
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outs):
                first = time.perf_counter()
        end = time.perf_counter()
        if i >= args.num_iters_warmup:
            ttfts.append(first - t0)
            e2es.append(end - t0)
            tpots.append((end - first) / max(args.output_len - 1, 1))
    result = {"engine": "kvserve", "dtype": str(engine.dtype).removeprefix("torch."), "input_len": args.input_len,
              "output_len": args.output_len, "num_iters": args.num_iters, "load_s": round(load_s, 2)}
    for name, values in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("e2e_ms", e2es)):
        ms = np.asarray(values) * 1000
        result[name] = {"mean": round(float(ms.mean()), 2),
                        **{f"p{p}": round(float(np.percentile(ms, p)), 2) for p in (50, 90, 99)}}
        print(f"{name[:-3].upper():5s} ms: mean {ms.mean():8.2f}  p50 {np.percentile(ms, 50):8.2f}  "
              f"p90 {np.percentile(ms, 90):8.2f}  p99 {np.percentile(ms, 99):8.2f}")
    _write_json(args, result)
    return result


def _write_json(args, result: dict) -> None:
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32 | float16")
    p.add_argument("--quantization", "-q", choices=QUANTIZATION_CHOICES, default=None,
                   help="gguf: keep a .gguf file's quantized weights (the default on the CPU); int8: W8A8, any "
                        "checkpoint's linears quantized to int8 at load (CPU); none: weights in --dtype")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 512MiB (default: 1 GiB on CPU)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="auto: the model's dtype; fp8 / fp8_e4m3 / fp8_e5m2: one byte per K/V value")
    p.add_argument("--calculate-kv-scales", action="store_true", default=None,
                   help="FP8 KV: set each layer's K and V scales from the first step (default: 1.0)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="also write the figures to this JSON file")


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `kvserve bench throughput`."""
    _add_engine_arguments(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=parse_range(DEFAULT_INPUT_LEN), help="N or A:B")
    p.add_argument("--output-len", type=parse_range, default=parse_range(DEFAULT_OUTPUT_LEN), help="N or A:B")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--no-tqdm", action="store_true")
    p.add_argument("--disable-detokenize", action="store_true", help="as vLLM's flag: skip detokenizing outputs")
    p.add_argument("--output-tokens", default=None, help="write every request's output token ids to this JSON file")
    p.add_argument("--save-workload", default=None,
                   help="write the workload (prompt token ids, output lengths) to this JSON file, for a peer to run")
    p.set_defaults(bench_func=run_throughput)


def add_latency_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `kvserve bench latency`."""
    _add_engine_arguments(p)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=8)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--prefix-cache-hits", action="store_true", help="keep the prefix cache between iterations")
    p.set_defaults(bench_func=run_latency)


def add_bench_arguments(subparsers) -> argparse.ArgumentParser:
    """Register `bench` with its `throughput`, `latency` and `serve` subcommands on a CLI's subparsers."""
    from kvserve.entrypoints.bench_serve import add_serve_bench_arguments
    from kvserve.entrypoints.perplexity import add_perplexity_arguments
    bench = subparsers.add_parser("bench", help="offline throughput and latency benchmarks, and a serving client")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    add_throughput_arguments(kinds.add_parser("throughput", help="many random requests at once"))
    add_latency_arguments(kinds.add_parser("latency", help="one request at a time: TTFT and TPOT"))
    add_perplexity_arguments(kinds.add_parser(
        "perplexity", help="perplexity over a text file, computed as llama.cpp's llama-perplexity"),
        _add_engine_arguments)
    add_serve_bench_arguments(kinds.add_parser(
        "serve", help="a client for a running OpenAI-compatible server (vllm bench serve's random workload)"))
    bench.set_defaults(func=run_bench)
    return bench


def run_bench(args) -> dict:
    """Entry point for a parsed `bench` command line."""
    return args.bench_func(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_bench_arguments(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    run_bench(parser.parse_args(["bench", *argv]))


if __name__ == "__main__":
    main()
