"""The GPU check (`make gpu-check`): on a machine with an NVIDIA GPU, in one run of a few minutes,

1. the CUDA tests: the Triton kernels natively in float32/bfloat16/float16/FP8 against the torch reference
   (tests/test_triton_attention.py), the layer ops against the torch ops (tests/test_triton_layer_ops.py), the
   engine on CUDA greedy against transformers in float32 and equal to itself with
   batching, chunked prefill, preemption, prefix caching and speculation (tests/test_triton_engine.py), and every
   kernel variant compiled under this machine's Triton (tests/test_triton_compile.py);
2. the benchmark, on random-weight models of real shapes in bfloat16 (SmolLM2-135M, Qwen2.5-Coder-1.5B: the GPU
   machine reaches no registry, so the real weights cannot travel there; speed does not depend on the values):
   - W1 offline throughput: 64 requests, prompts of 64-512 tokens, outputs of 32-256 (ignore_eos), kvserve's
     LLM.generate against transformers' generate on the same GPU (one left-padded batch of all 64, as HF serves
     them: every row runs to the longest output; both are credited only the tokens asked for);
   - the decode step at batch 64 (each request 256 tokens in) against the time to read the weights and the KV it
     attends to once at the measured read bandwidth;
   - single-stream TPOT against the same bound, and at ~2,000 tokens of context with split KV and without.

It runs with the machine's own python3 and packages; the tokenizer directory comes from KVSERVE_TEST_TOKENIZER
(`python benchmarks/gpu_check.py --prepare DIR` writes the bundled model's there, to carry). Writes
benchmarks/results/gpu_check.{json,md} (and into $OUT when set). Each part that fails is recorded as failed; the rest
still runs. `--tests A,B` runs those test files instead of the four; `--dry-run` runs the benchmark code on the CPU
on tiny shapes (Triton's interpreter), to try this script without a GPU."""
from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from gpu_check_report import markdown   # (benchmarks/, the script's directory)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DRY_RUN = "--dry-run" in sys.argv
DEVICE = "cpu" if DRY_RUN else "cuda"
if DRY_RUN:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # the Triton kernels on CPU tensors
PROFILE = "--profile" in sys.argv   # torch.profiler's table of decode steps at batch 64, into gpu_check_profile.txt
PROFILES: list[str] = []

TESTS = ["tests/test_triton_attention.py", "tests/test_triton_layer_ops.py", "tests/test_triton_engine.py",
         "tests/test_triton_compile.py"]
MODELS = {
    # name: (transformers config class, config kwargs) with the published checkpoints' shapes
    "SmolLM2-135M": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                                         tie_word_embeddings=True)),
    "Qwen2.5-Coder-1.5B": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                               max_position_embeddings=32768, rope_theta=1000000.0,
                                               rms_norm_eps=1e-6, tie_word_embeddings=True)),
}
if DRY_RUN:   # the same code on shapes the interpreter runs in seconds
    MODELS = {"tiny-llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                                 max_position_embeddings=2048, tie_word_embeddings=True))}


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def log(*args):
    print(*args, flush=True)


def run_tests(result: dict, files: list[str]) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    log("\n".join(tail[-40:]))
    result["tests"] = {"files": files, "exit_code": proc.returncode, "summary": tail[-1] if tail else "",
                       "seconds": round(time.perf_counter() - t0, 1),
                       "failures": [line for line in tail if line.startswith("FAILED")][:20]}


def read_bandwidth() -> float:
    """Bytes per second a reduction reads from a 4 GiB bfloat16 tensor (best of 5)."""
    x = torch.ones(2 << 30 if DEVICE == "cuda" else 1 << 24, dtype=torch.bfloat16, device=DEVICE)
    best = float("inf")
    for _ in range(6):
        sync()
        t = time.perf_counter()
        x.sum(dtype=torch.float32)
        sync()
        best = min(best, time.perf_counter() - t)
    n = x.numel() * 2
    del x
    empty_cache()
    return n / best


def make_model(name: str, root: Path) -> Path:
    """A random-weight checkpoint of the model's shape in bfloat16 (safetensors)."""
    import transformers
    cls, kwargs = MODELS[name]
    config = getattr(transformers, cls)(**kwargs, bos_token_id=1, eos_token_id=2)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = root / name
    model.save_pretrained(str(path))
    del model
    empty_cache()
    return path


def w1_requests(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, scale = (8, 8) if DRY_RUN else (64, 1)
    prompt_lens = rng.integers(64 // scale, 513 // scale, n)
    output_lens = rng.integers(32 // scale, 257 // scale, n)
    prompts = [rng.integers(3, vocab, n).tolist() for n in prompt_lens]
    return prompts, output_lens.tolist()


def bench_kvserve(path: Path, tokenizer: str, prompts, output_lens, w1: bool = True, **engine_kwargs) -> dict:
    from kvserve import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(model=str(path), tokenizer=tokenizer, dtype="float32" if DRY_RUN else "bfloat16", device=DEVICE,
              max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.3,
              attention_backend="triton", **engine_kwargs)
    start_s = time.perf_counter() - t
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params[:4], use_tqdm=False)   # kernels' JIT
    if not w1:
        return {"llm": llm, "start_s": start_s}
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(output_lens), (produced, sum(output_lens))
    return {"seconds": seconds, "start_s": start_s, "llm": llm}


def bench_hf(path: Path, prompts, output_lens) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(DEVICE).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):   # left padding, as generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    new = max(output_lens)
    with torch.inference_mode():
        model.generate(ids[:4, -64:], attention_mask=mask[:4, -64:], max_new_tokens=8, do_sample=False,
                       pad_token_id=0)
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
        sync()
    seconds = time.perf_counter() - t
    assert out.shape[1] == width + new
    del model, out
    empty_cache()
    return {"seconds": seconds}


def step_times(llm, prompts, max_tokens: int, steps: int, probe=None) -> list[float]:
    """Seconds of each of `steps` engine steps once every request decodes (its prefill done), from the end of one
    step() to the end of the next: with async scheduling a step() returns once the step behind it is launched,
    so waiting for the device after each would hide what the overlap gains (without it, each step() waits for its
    tokens anyway). probe(): called after the timed steps, while the requests still run."""
    from kvserve import SamplingParams
    from kvserve.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                          output_kind=RequestOutputKind.DELTA))   # as the server streams
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    times = []
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
        times.append(time.perf_counter() - t)
        t += times[-1]
    if probe is not None:
        probe()
    while engine.has_unfinished_requests():
        engine.step()
    return times


def profile_steps(llm, prompts, name: str) -> str:
    """torch.profiler's table of a few decode steps (host time and device time per op), for where a step goes."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        step_times(llm, prompts, 12, 4)
    sort = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    text = (f"== {name}: {len(prompts)} requests, 4 decode steps\n"
            + prof.key_averages().table(sort_by=sort, row_limit=25)
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return text


def replay_probe(llm, size: int, into: dict, key: str, times: int = 20):
    """A step_times probe: the device time of the decode forward's graph for `size` alone (ms, CUDA events), replayed
    `times` times on the last step's inputs (each replay writes the same K/V into the same slots: the requests are
    still running, their blocks theirs). Against the step's time, it says how much of a step is the device's
    forward, and how much the host, the logits, sampling and copies. No graph (CPU, eager): nothing recorded."""
    def probe() -> None:
        graphs = llm.llm_engine.runner.decode_graphs
        if DEVICE != "cuda" or graphs is None or size not in graphs.graphs:
            return
        try:
            graph = graphs.graphs[size]
            sync()
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(times):
                graph.replay()
            end.record()
            sync()
            into[key] = round(start.elapsed_time(end) / times, 3)
        except Exception as e:   # a diagnostic: the step's own figures stand without it
            into[key] = f"failed: {type(e).__name__}: {e}"[:120]
            return
        try:
            into[f"{key}_kernels"] = graph_kernels(graph)
        except Exception as e:   # the replay's time stands without it
            into[f"{key}_kernels"] = f"failed: {type(e).__name__}: {e}"[:120]
    return probe


def graph_kernels(graph, replays: int = 5, top: int = 16) -> list[dict]:
    """What one replay of a captured graph runs on the device (torch.profiler's CUDA activity, which records the
    kernels of graph replays): each kernel's launches and microseconds per replay, the longest first, and their sum:
    which kernels a step's forward spends its time in, and how many there are."""
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        sync()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            rows.append({"kernel": e.key[:90], "launches": round(e.count / replays, 2), "us": round(us / replays, 1)})
    rows.sort(key=lambda r: -r["us"])
    total = {"kernel": "(all)", "launches": round(sum(r["launches"] for r in rows), 1),
             "us": round(sum(r["us"] for r in rows), 1)}
    return [total] + rows[:top]


def weight_bytes(llm) -> int:
    model = llm.llm_engine.model
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen and t.device.type == DEVICE:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(llm) -> int:
    from kvserve.attention import attention_layers
    return sum(2 * a.num_kv_heads * a.head_dim * a.k_cache.element_size()
               for a in attention_layers(llm.llm_engine.model))


def decode_figures(llm, vocab: int, wb: int, kvb: int, bandwidth: float, label: str) -> dict:
    """The median decode step at batch 64 (256 tokens in) and single-stream (128 in), each against the time to read
    the weights and the KV it attends to at `bandwidth`."""
    rng = np.random.default_rng(1)
    batch = [rng.integers(3, vocab, 256).tolist() for _ in range(4 if DRY_RUN else 64)]
    replay: dict = {}
    step = float(np.median(step_times(llm, batch, 48, 4 if DRY_RUN else 32,
                                      replay_probe(llm, len(batch), replay, f"decode64_{label}_replay_ms"))))
    bound = (wb + 64 * (256 + 16) * kvb) / bandwidth   # the median step's context, about 16 tokens past the prompt
    tpot = float(np.median(step_times(llm, [rng.integers(3, vocab, 128).tolist()], 80, 4 if DRY_RUN else 64,
                                      replay_probe(llm, 1, replay, f"tpot_{label}_replay_ms"))))
    bound1 = (wb + 160 * kvb) / bandwidth
    log(f"{label}: decode step at batch 64 {step * 1e3:.2f} ms (bound {bound * 1e3:.3f}), TPOT {tpot * 1e3:.2f} ms "
        f"(bound {bound1 * 1e3:.3f})")
    if PROFILE:
        PROFILES.append(profile_steps(llm, batch, label))
    return {**replay, f"decode64_{label}_ms": round(step * 1e3, 3), "decode64_bound_ms": round(bound * 1e3, 3),
            f"decode64_{label}_vs_bound": round(step / bound, 2), f"tpot_{label}_ms": round(tpot * 1e3, 3),
            "tpot_bound_ms": round(bound1 * 1e3, 3), f"tpot_{label}_vs_bound": round(tpot / bound1, 2)}


def long_context_figures(llm, vocab: int, wb: int, kvb: int, bandwidth: float) -> dict:
    """Single-stream TPOT at about 2,000 tokens of context with graphs: the decode's keys split over the GPU (split
    KV, the default: kvserve.attention.triton.ops.decode_splits) and not (the graphs captured again without),
    against the time to read the weights and that KV once."""
    from kvserve.attention.triton import ops
    n = 192 if DRY_RUN else 1920
    prompt = [np.random.default_rng(2).integers(3, vocab, n).tolist()]
    bound = (wb + (n + 40) * kvb) / bandwidth
    out = {"tpot_long_bound_ms": round(bound * 1e3, 3)}
    graphs = llm.llm_engine.runner.decode_graphs
    captured = graphs is not None and bool(graphs.graphs)
    target = ops.SPLIT_TARGET_PROGRAMS

    def recapture():   # decode_splits reads SPLIT_TARGET_PROGRAMS at each launch, the captures' too
        if captured:
            graphs.graphs.clear()
            graphs.outputs.clear()
            graphs.capture_all()

    try:
        for label, value in (("split", target), ("unsplit", 0)):   # a target of 0 programs: never split
            if value != ops.SPLIT_TARGET_PROGRAMS:
                ops.SPLIT_TARGET_PROGRAMS = value
                recapture()
            tpot = float(np.median(step_times(llm, prompt, 80, 4 if DRY_RUN else 64)))
            out[f"tpot_long_{label}_ms"] = round(tpot * 1e3, 3)
    except Exception as e:   # the rest of the check goes on
        out["tpot_long_error"] = f"{type(e).__name__}: {e}"[:200]
    if ops.SPLIT_TARGET_PROGRAMS != target:
        ops.SPLIT_TARGET_PROGRAMS = target
        try:
            recapture()
        except Exception as e:   # the engine's later figures run without graphs then: said in the row
            out["tpot_long_restore_error"] = f"{type(e).__name__}: {e}"[:200]
    log(f"TPOT at {n} tokens of context: {out}")
    return out


def bench_model(name: str, root: Path, tokenizer: str, bandwidth: float) -> dict:
    log(f"== {name}")
    path = make_model(name, root)
    vocab = MODELS[name][1]["vocab_size"]
    prompts, output_lens = w1_requests(vocab)
    useful = sum(output_lens)
    total_tokens = useful + sum(map(len, prompts))
    row = {"model": name, "requests": len(prompts), "output_tokens": useful, "prompt_tokens": total_tokens - useful}
    kv = bench_kvserve(path, tokenizer, prompts, output_lens)
    llm = kv.pop("llm")
    row["kvserve_s"] = round(kv["seconds"], 3)
    row["kvserve_start_s"] = round(kv["start_s"], 1)
    row["kvserve_out_tok_s"] = round(useful / kv["seconds"], 1)
    row["kvserve_total_tok_s"] = round(total_tokens / kv["seconds"], 1)
    log(f"kvserve W1: {kv['seconds']:.2f} s, {useful / kv['seconds']:.0f} output tok/s")
    graphs = llm.llm_engine.runner.decode_graphs
    row["graphs"] = (f"{len(graphs.graphs)} sizes captured in {graphs.capture_seconds:.1f} s" if graphs is not None
                     and graphs.graphs else "none")
    wb, kvb = weight_bytes(llm), kv_bytes_per_token(llm)
    row["weight_bytes"] = wb
    row["async_scheduling"] = llm.llm_engine.async_scheduling
    row.update(decode_figures(llm, vocab, wb, kvb, bandwidth, "graphs"))
    row.update(long_context_figures(llm, vocab, wb, kvb, bandwidth))
    engine = llm.llm_engine
    while engine._pending is not None:   # a launched step not merged yet: merge it before switching
        engine.step()
    engine.async_scheduling = not engine.async_scheduling   # the same engine, the other way of stepping
    row.update(decode_figures(llm, vocab, wb, kvb, bandwidth, "graphs_other_scheduling"))
    llm.llm_engine.shutdown()
    del llm, engine, graphs   # every reference to the engine (graphs holds the model): its memory goes back
    empty_cache()
    eager = bench_kvserve(path, tokenizer, prompts, output_lens, w1=False, enforce_eager=True)["llm"]
    row.update(decode_figures(eager, vocab, wb, kvb, bandwidth, "eager"))
    eager.llm_engine.shutdown()
    del eager
    empty_cache()
    hf = bench_hf(path, prompts, output_lens)
    row["hf_s"] = round(hf["seconds"], 3)
    row["hf_out_tok_s"] = round(useful / hf["seconds"], 1)
    row["speedup_vs_hf"] = round(hf["seconds"] / kv["seconds"], 2)
    log(f"HF generate W1: {hf['seconds']:.2f} s -> kvserve {row['speedup_vs_hf']}x")
    return row


def prepare(directory: str) -> int:
    """Save the bundled model's tokenizer as a plain directory, for a GPU machine without the bundled model."""
    from kvserve.model import default_model_path, load_tokenizer
    load_tokenizer(default_model_path()).save_pretrained(directory)
    print(f"tokenizer saved in {directory}: carry it and set KVSERVE_TEST_TOKENIZER={directory}")
    return 0


def main() -> int:
    if "--prepare" in sys.argv:
        return prepare(sys.argv[sys.argv.index("--prepare") + 1])
    if not DRY_RUN and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; this check runs on a machine with an NVIDIA GPU (--dry-run: on the "
              "CPU, tiny shapes)")
        return 2
    if not DRY_RUN:
        os.environ.pop("TRITON_INTERPRET", None)
    import triton
    tokenizer = os.environ.get("KVSERVE_TEST_TOKENIZER")
    if tokenizer:
        os.environ["KVSERVE_TEST_TOKENIZER"] = tokenizer = str(Path(tokenizer).resolve())
    gpu = "CPU dry run (Triton interpreter)" if DRY_RUN else torch.cuda.get_device_name()
    result = {"env": {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                      "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}}
    tests = TESTS
    if "--tests" in sys.argv:   # a subset, comma-separated
        tests = sys.argv[sys.argv.index("--tests") + 1].split(",")
    only = {a for a in sys.argv[1:] if not a.startswith("-") and a not in (",".join(tests),)}
    if not DRY_RUN and (not only or "tests" in only):
        try:
            run_tests(result, tests)
        except Exception as e:
            result["tests"] = {"summary": f"failed to run: {e}"}
    save(result)
    result["env"]["read_bandwidth_gbs"] = round(read_bandwidth() / 1e9)
    if tokenizer is None:
        from kvserve.model import default_model_path
        tokenizer = default_model_path()
    result["models"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            if only and name not in only and "bench" not in only:
                continue
            try:
                result["models"].append(bench_model(name, Path(tmp), tokenizer,
                                                    result["env"]["read_bandwidth_gbs"] * 1e9))
            except Exception as e:
                traceback.print_exc()
                result["models"].append({"model": name, "error": f"{type(e).__name__}: {e}"})
            save(result)   # what is measured so far survives a run cut short
    print(markdown(result))
    return 0 if result.get("tests", {}).get("exit_code", 0) == 0 else 1


def save(result: dict) -> None:
    text = markdown(result)
    outs = [] if DRY_RUN else [ROOT / "benchmarks" / "results"]
    outs += [Path(os.environ["OUT"])] if os.environ.get("OUT") else []
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
        (out / "gpu_check.md").write_text(text)
        if PROFILES:
            (out / "gpu_check_profile.txt").write_text("\n".join(PROFILES))


if __name__ == "__main__":
    sys.exit(main())
