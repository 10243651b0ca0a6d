"""The bundled model's real weights on an NVIDIA GPU (`make gpu-check-model`): kvserve's greedy output on CUDA in
float32, token for token against transformers' on the same weights and GPU, and each token's logprob beside it.

The GPU check's CUDA tests run tiny random-weight models; this runs SmolLM2-135M-Instruct's own weights (the
bundled Q4_1 GGUF, which kvserve on CUDA and transformers both dequantize to float32). The file (94 MiB) is more
than one call to the GPU machine carries (64 MiB, the tree included), so it travels in halves, in two calls of one
lease; the machine keeps the first call's files while it stays warm (it goes back after 30 s idle):

  python benchmarks/gpu_model_check.py --prepare .gpu-carry      # here: .gpu-carry/call1 (the tokenizer, the
                                                                 # file's first half and sha256, gguf's wheel)
                                                                 # and .gpu-carry/call2 (the second half)
  call 1, carry [".gpu-carry/call1"]:  KVSERVE_TEST_TOKENIZER=.gpu-carry/call1/tokenizer make gpu-check
  call 2 at once, carry [".gpu-carry/call2"]:  make gpu-check-model   (the carried tokenizer, not a conversion)

Three engines on the same prompts (batched, all at once): the default on CUDA (decode steps replaying CUDA graphs,
async scheduling); eager with chunked prefill (a step budget of 32 tokens); and that one again on the same prompts,
now prefix-cache hits. Writes benchmarks/results/gpu_model_check.{json,md} (and into $OUT when set).
`--dry-run` runs it on the CPU (the C++ kernels; the bundled model found as kvserve finds it), to try this script.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
DRY_RUN = "--dry-run" in sys.argv
DEVICE = "cpu" if DRY_RUN else "cuda"
MAX_TOKENS = 8 if DRY_RUN else 32
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three colours of the rainbow.",
    "Translate 'good morning' into Spanish and German.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Explain in two sentences why the sky is blue.",
    "1, 2, 3, 5, 8, 13,",
    "The quick brown fox",
]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOGPROB_TOLERANCE = 1e-3   # float32 throughout; the sums run in other orders (cuBLAS and our kernels against
                           # transformers' attention), so logprobs agree to about 1e-5 and tokens exactly


def log(*args):
    print(*args, flush=True)


def prepare(directory: str) -> int:
    """Write the two calls' folders (split_model) and gguf's wheel into call1."""
    call1, call2 = split_model(Path(directory))
    from importlib.metadata import version   # transformers reads GGUF files through gguf: the GPU machine lacks it
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"gguf=={version('gguf')}",
                    "-d", str(call1)], check=True)
    sizes = [sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) >> 20 for d in (call1, call2)]
    print(f"{call1}: {sizes[0]} MiB, {call2}: {sizes[1]} MiB; carry each in its own call (module doc)")
    return 0


def split_model(out: Path) -> tuple[Path, Path]:
    """out/call1 (the tokenizer, the bundled GGUF's first half, model.json: its name, size and sha256) and
    out/call2 (the second half), made afresh."""
    from kvserve.model import default_model_path, load_tokenizer
    call1, call2 = out / "call1", out / "call2"
    for d in (call1, call2):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    model = Path(default_model_path())
    load_tokenizer(str(model)).save_pretrained(str(call1 / "tokenizer"))
    data = model.read_bytes()
    half = len(data) // 2
    (call1 / "model.part1").write_bytes(data[:half])
    (call2 / "model.part2").write_bytes(data[half:])
    (call1 / "model.json").write_text(json.dumps({"name": model.name, "bytes": len(data),
                                                  "sha256": hashlib.sha256(data).hexdigest()}))
    return call1, call2


def assemble(directory: Path, tmp: Path) -> Path:
    """The GGUF from the halves the two calls carried, its sha256 checked."""
    call1, call2 = directory / "call1", directory / "call2"
    missing = [str(p) for p in (call1 / "model.part1", call1 / "model.json", call2 / "model.part2") if not p.exists()]
    if missing:
        raise SystemExit(f"gpu_model_check: missing {', '.join(missing)}: call 1 (carrying {call1}) and call 2 "
                         f"(carrying {call2}) must run on the same warm machine (module doc)")
    meta = json.loads((call1 / "model.json").read_text())
    path = tmp / meta["name"]
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (call1 / "model.part1", call2 / "model.part2"):
            data = part.read_bytes()
            digest.update(data)
            f.write(data)
    if digest.hexdigest() != meta["sha256"]:
        raise SystemExit(f"gpu_model_check: the assembled {meta['name']} does not match its sha256")
    for wheel in sorted(call1.glob("gguf-*.whl")):   # pure Python: importable from the wheel itself, here and in
        sys.path.insert(0, str(wheel))              # the processes the engine starts
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(wheel), os.environ.get("PYTHONPATH")) if p)
    return path


def kvserve_greedy(model: str, tokenizer: str | None, prompts: list[list[int]], runs: int = 1,
                   **engine_kwargs) -> list[dict]:
    """kvserve's greedy outputs (token ids, each token's logprob), all prompts at once, `runs` times."""
    from kvserve import LLM, SamplingParams
    llm = LLM(model=model, tokenizer=tokenizer, dtype="float32", device=DEVICE, quantization="none", seed=0,
              max_model_len=1024,
              **({"gpu_memory_utilization": 0.3} if DEVICE == "cuda" else {"kv_cache_memory": "256MiB"}),
              **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    results = []
    try:
        for _ in range(runs):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            results.append([(list(o.outputs[0].token_ids),
                             [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                            for o in outs])
    finally:
        llm.llm_engine.shutdown()
    return results


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where a and b differ (one's length where it is the other's start)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(name: str, got: list, want: list) -> dict:
    """One engine's outputs against transformers': prompts equal, the first difference, the logprobs' distance."""
    equal = sum(g[0] == w[0] for g, w in zip(got, want))
    first = next((f"prompt {i}, token {first_difference(g[0], w[0])}" for i, (g, w) in enumerate(zip(got, want))
                  if g[0] != w[0]), None)
    # logprobs compared where the tokens still agree (after a difference the contexts differ)
    diffs = [abs(a - b) for g, w in zip(got, want) for (ta, a), (tb, b) in zip(zip(g[0], g[1]), zip(w[0], w[1]))
             if ta == tb]
    row = {"engine": name, "prompts": len(want), "equal": equal, "first_difference": first,
           "max_logprob_diff": max(diffs, default=0.0)}
    row["ok"] = equal == len(want) and row["max_logprob_diff"] <= LOGPROB_TOLERANCE
    log(json.dumps(row))
    return row


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"Real-weights check on {env['device']} ({env['date']}): {env['model']}, float32, {env['prompts']} "
             f"prompts x {env['max_tokens']} greedy tokens, against transformers {env['transformers']} on the same "
             f"device (logprob tolerance {LOGPROB_TOLERANCE})", "",
             "| engine | prompts token-identical | first difference | max logprob difference | ok |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['engine']} | {r['equal']} / {r['prompts']} | {r['first_difference'] or '-'} | "
                     f"{r['max_logprob_diff']:.2e} | {'yes' if r['ok'] else 'NO'} |")
    if "error" in result:
        lines += ["", f"failed: {result['error']}"]
    return "\n".join(lines) + "\n"


def save(result: dict) -> None:
    outs = [] if DRY_RUN else [ROOT / "benchmarks" / "results"]   # a dry run's figures are no GPU's
    for d in outs + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / "gpu_model_check.json").write_text(json.dumps(result, indent=1))
        (d / "gpu_model_check.md").write_text(markdown(result))


def run(model: Path, tokenizer: str | None) -> dict:
    """`tokenizer`: the carried copy of the GGUF's (None: converted from the GGUF)."""
    import torch
    import transformers
    result = {"env": {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)",
                      "model": model.name, "torch": torch.__version__, "transformers": transformers.__version__,
                      "date": time.strftime("%Y-%m-%d"), "prompts": len(PROMPTS), "max_tokens": MAX_TOKENS},
              "rows": []}
    try:
        from transformers_reference import greedy_with_logprobs, load_gguf_reference
        from kvserve.model import load_tokenizer
        torch.backends.cuda.matmul.allow_tf32 = False   # float32 means float32 on both sides
        torch.backends.cudnn.allow_tf32 = False
        tok = load_tokenizer(str(model), tokenizer)
        prompts = [tok.encode(p) for p in PROMPTS]
        t0 = time.perf_counter()
        hf = load_gguf_reference(str(model), DEVICE)
        want = greedy_with_logprobs(hf, prompts, MAX_TOKENS)
        del hf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        log(f"transformers: {time.perf_counter() - t0:.1f} s")
        (default,) = kvserve_greedy(str(model), tokenizer, prompts)
        result["rows"].append(compare("default (graphs, async scheduling)" if DEVICE == "cuda" else "default",
                                      default, want))
        fresh, cached = kvserve_greedy(str(model), tokenizer, prompts, runs=2, enforce_eager=True,
                                       max_num_batched_tokens=32)
        result["rows"].append(compare("eager, chunked prefill of 32 tokens", fresh, want))
        result["rows"].append(compare("the same again: prefix-cache hits", cached, want))
    except Exception as e:   # what ran is still written
        result["error"] = f"{type(e).__name__}: {e}"
    return result


def main() -> int:
    if "--prepare" in sys.argv:
        return prepare(sys.argv[sys.argv.index("--prepare") + 1])
    if not DRY_RUN:
        import torch
        if not torch.cuda.is_available():
            print("gpu_model_check: no CUDA device here (--dry-run: on the CPU)")
            return 2
        os.environ.pop("TRITON_INTERPRET", None)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    with tempfile.TemporaryDirectory() as tmp:
        if DRY_RUN and not args:
            from kvserve.model import default_model_path
            model, tokenizer = Path(default_model_path()), None
        else:
            carried = Path(args[0] if args else ROOT / ".gpu-carry")
            model, tokenizer = assemble(carried, Path(tmp)), str(carried / "call1" / "tokenizer")
        result = run(model, tokenizer)
    save(result)
    print(markdown(result))
    return 0 if result["rows"] and all(r["ok"] for r in result["rows"]) and "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
