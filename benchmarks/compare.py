"""kvserve against its peers on the same workloads, one engine after another; writes docs/benchmarks.md.

  python benchmarks/compare.py                 # everything that is installed (make bench)
  python benchmarks/compare.py --only offline  # W1 only; --only serve: S1, single stream and start-up
  python benchmarks/compare.py --skip-hf --skip-vllm --num-prompts 16   # a quick kvserve-only run

Workloads (the performance issue's):
  W1 offline: N random-token prompts of 64-512 tokens, 32-256 output tokens each, greedy, ignore_eos, seed 0.
  S1 serving burst: `vllm bench serve` random 256 in / 128 out, 64 requests at once; --s1-runs times (3) with
  new prompts, the run with the median output throughput reported and every run listed.
  Single stream: `vllm bench serve --max-concurrency 1`, 8 requests, 256 in / 128 out.
  Start-up: seconds from launching the server until the first request is answered.
  Concurrency sweep: `vllm bench serve --max-concurrency C` with 2C requests for C in 4, 16 (with the single
  stream at 1 and S1 at 64: the throughput-vs-concurrency plot).
Peers, each in its own process: HF transformers (float32 model.generate over static left-padded batches of 16,
the GGUF's weights), vLLM's CPU build (its own venv under $PEERS, default ~/peers, installed by `make peers`:
see benchmarks/peers/README.md; skipped with a message when missing). Every engine gets the same token ids.
Results: benchmarks/results/compare.json; compare_report.py turns them into docs/benchmarks.md and the plots in
docs/ (the optimization log at the end of that file is kept as written).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from compare_report import log, plot, report, write_doc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
PEERS = Path(os.environ.get("PEERS", Path.home() / "peers"))   # the Makefile's default too
PEERS_SCRIPTS = ROOT / "benchmarks" / "peers"
VLLM_PY = PEERS / "venv-vllm" / "bin" / "python"
VLLM_BIN = PEERS / "venv-vllm" / "bin" / "vllm"
HF_DIR = PEERS / "smollm2-135m-instruct"
# the same settings as benchmarks/peers/vllm-env.sh
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
            "VLLM_USE_AOT_COMPILE": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
PY = sys.executable
SWEEP = (4, 16)   # extra --max-concurrency points between the single stream and S1


def load_avg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


# ----- the workload, shared by every engine -----
def make_workload(path: Path, num_prompts: int, seed: int) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from kvserve.entrypoints.bench import random_workload
    from kvserve.model import load_tokenizer
    from kvserve.model.gguf_loader import gguf_model_config, open_gguf
    from kvserve.model.loader import default_model_path
    tok = load_tokenizer(None)
    vocab = gguf_model_config(open_gguf(default_model_path())).vocab_size
    special = sorted(set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {}))
    work = random_workload(num_prompts, (64, 512), (32, 256), seed, vocab, special)
    path.write_text(json.dumps(work))
    return work


def run_json(cmd: list[str], out: Path, env: dict | None = None, timeout: int = 3600) -> dict | None:
    """Run a benchmark subprocess that writes its figures to `out`; None (and its output) if it failed."""
    log("$ " + " ".join(map(str, cmd)))
    t0 = time.perf_counter()
    proc = subprocess.run(list(map(str, cmd)), env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        log(f"failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return None
    result = json.loads(out.read_text())
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    log(json.dumps(result))
    return result


# ----- W1 offline -----
def kvserve_offline(args, work_path: Path, tmp: Path, quantization: str = "none",
                    env: dict | None = None) -> dict | None:
    out = tmp / "kvserve.json"
    cmd = [PY, "-m", "kvserve.entrypoints.bench", "throughput", "--num-prompts", args.num_prompts,
           "--input-len", "64:512", "--output-len", "32:256", "--seed", args.seed, "--dtype", "bfloat16",
           "--quantization", quantization, "--no-tqdm", "--output-json", out]
    return run_json(cmd, out, env)


HF_SCRIPT = r'''
import json, sys, time, torch
from transformers import AutoModelForCausalLM
work, gguf, out, batch = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], int(sys.argv[4])
d, f = gguf.rsplit("/", 1)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
t0 = time.perf_counter(); generated = 0
for i in range(0, len(work), batch):
    chunk = work[i:i + batch]
    width = max(len(w["prompt_token_ids"]) for w in chunk)
    ids = torch.tensor([[pad] * (width - len(w["prompt_token_ids"])) + w["prompt_token_ids"] for w in chunk])
    mask = torch.tensor([[0] * (width - len(w["prompt_token_ids"])) + [1] * len(w["prompt_token_ids"]) for w in chunk])
    n = max(w["output_len"] for w in chunk)   # a static batch runs until its longest request is done
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=pad)
    generated += n * len(chunk)
elapsed = time.perf_counter() - t0
num_in = sum(len(w["prompt_token_ids"]) for w in work); num_out = sum(w["output_len"] for w in work)
json.dump({"engine": "transformers", "dtype": "float32", "batch_size": batch, "elapsed_s": round(elapsed, 3),
           "num_output_tokens": num_out, "num_generated_incl_padding": generated,
           "output_tokens_per_s": round(num_out / elapsed, 2), "total_tokens_per_s": round((num_in + num_out) / elapsed, 2),
           "requests_per_s": round(len(work) / elapsed, 3)}, open(out, "w"))
'''

VLLM_OFFLINE_SCRIPT = r'''
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    work, model, out = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
    dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0)
    load_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in work]
    params = [SamplingParams(temperature=0, max_tokens=w["output_len"], ignore_eos=True) for w in work]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    num_in = sum(len(o.prompt_token_ids) for o in outs); num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    import vllm
    json.dump({"engine": "vllm", "version": vllm.__version__, "dtype": dtype, "elapsed_s": round(elapsed, 3),
               "num_output_tokens": num_out, "output_tokens_per_s": round(num_out / elapsed, 2),
               "total_tokens_per_s": round((num_in + num_out) / elapsed, 2),
               "requests_per_s": round(len(outs) / elapsed, 3), "load_s": round(load_s, 1)}, open(out, "w"))
'''


def hf_offline(args, work_path: Path, tmp: Path) -> dict | None:
    from kvserve.model.loader import default_model_path
    out, script = tmp / "hf.json", tmp / "hf_generate.py"
    script.write_text(HF_SCRIPT)
    return run_json([PY, script, work_path, default_model_path(), out, 16], out, {"TOKENIZERS_PARALLELISM": "false"})


def vllm_available() -> bool:
    if VLLM_PY.exists() and VLLM_BIN.exists():
        return True
    log(f"vLLM is not installed at {VLLM_PY.parent.parent}: skipping it "
        "(install: make peers)")
    return False


def ensure_hf_model() -> bool:
    """The bf16 HF copy of the bundled GGUF that vLLM needs (made once, as `make peers` does)."""
    if (HF_DIR / "config.json").exists():
        return True
    from kvserve.model.loader import default_model_path
    proc = subprocess.run([str(VLLM_PY), str(PEERS_SCRIPTS / "make-hf-model.py"), str(default_model_path()),
                           str(HF_DIR)], capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"make-hf-model.py failed:\n{proc.stderr[-2000:]}")
    return proc.returncode == 0


def vllm_offline(args, work_path: Path, tmp: Path, dtype: str = "bfloat16", env: dict | None = None) -> dict | None:
    out, script = tmp / "vllm.json", tmp / "vllm_generate.py"
    script.write_text(VLLM_OFFLINE_SCRIPT)
    return run_json([VLLM_PY, script, work_path, HF_DIR, out, dtype], out, {**VLLM_ENV, **(env or {})})


# ----- serving: S1 burst, single stream, start-up -----
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def first_answer(url: str, model: str) -> bool:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status == 200


class Server:
    """A server subprocess; start-up time is launch -> first completion answered."""

    def __init__(self, name: str, cmd: list[str], env: dict | None, model: str, log_path: Path):
        self.name, self.model = name, model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([*map(str, cmd), "--port", str(self.port)], env={**os.environ, **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        ok = wait_ready(self.url, self.proc, 600) and first_answer(self.url, model)
        self.startup_s = round(time.perf_counter() - t0, 2) if ok else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def bench_serve(server: Server, tmp: Path, tag: str, num_prompts: int, concurrency: int | None,
                seed: int) -> dict | None:
    """`vllm bench serve` against the server; each run gets its own seed, so no prompt is a prefix-cache hit."""
    out = tmp / f"{server.name}-{tag}.json"
    cmd = [VLLM_BIN, "bench", "serve", "--backend", "openai", "--base-url", server.url, "--endpoint",
           "/v1/completions", "--model", server.model, "--tokenizer", HF_DIR, "--dataset-name", "random",
           "--random-input-len", "256", "--random-output-len", "128", "--num-prompts", num_prompts, "--seed", seed,
           "--ignore-eos", "--temperature", "0", "--save-result", "--result-dir", tmp, "--result-filename", out.name]
    if concurrency:
        cmd += ["--max-concurrency", concurrency]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = run_json(cmd, out, {**env, **VLLM_ENV})
    if r is None:
        return None
    keep = ("completed", "total_output_tokens", "duration", "output_throughput", "total_token_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms")
    figures = {k: r.get(k) for k in keep}
    if figures["total_output_tokens"] != num_prompts * 128:
        log(f"warning: {server.name} generated {figures['total_output_tokens']} tokens, expected {num_prompts * 128}")
    return figures


def serve_all(args, tmp: Path) -> dict:
    results = {}
    # the weights vLLM and transformers get: the GGUF dequantized (docs/quantization.md compares kept quantized)
    engines = [("kvserve", [PY, "-m", "kvserve", "serve", "--host", "127.0.0.1", "--dtype", "bfloat16",
                            "--quantization", "none", "--served-model-name", "smollm2"], {})]
    engines.append(("vllm", [VLLM_BIN, "serve", HF_DIR, "--host", "127.0.0.1", "--dtype", "bfloat16",
                             "--max-model-len", "2048", "--served-model-name", "smollm2"], VLLM_ENV))
    for name, cmd, env in engines:
        if args.skip_vllm and name == "vllm":
            continue
        log(f"starting {name} server (load {load_avg()})")
        server = Server(name, cmd, env, "smollm2", tmp / f"{name}-server.log")
        try:
            if server.startup_s is None:
                log(f"{name} server did not come up; see {tmp / f'{name}-server.log'}")
                continue
            res = {"startup_s": server.startup_s, "load_before": load_avg()}
            # S1 several times (new prompts each: no prefix-cache hits); the run with the median throughput
            # stands for the engine, all are listed: single runs on a shared 2-core machine swing by 5-8%
            runs = [bench_serve(server, tmp, f"s1-{i}", 64, None, seed=100 * i) for i in range(args.s1_runs)]
            res["s1_runs"] = [r for r in runs if r]
            res["s1"] = (sorted(res["s1_runs"], key=lambda r: r["output_throughput"])[len(res["s1_runs"]) // 2]
                         if res["s1_runs"] else None)
            res["single_stream"] = bench_serve(server, tmp, "single", 8, 1, seed=1)
            # throughput against concurrency: 1 is the single stream, 64 is S1 (all 64 at once)
            res["sweep"] = {str(c): bench_serve(server, tmp, f"c{c}", 2 * c, c, seed=10 + c) for c in SWEEP}
            res["load_after"] = load_avg()
            results[name] = res
        finally:
            server.stop()
    return results


# ----- report -----
def versions() -> dict:
    import torch
    import transformers
    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        from kvserve import __version__
        v["kvserve"] = __version__
    except ImportError:
        pass
    if VLLM_PY.exists():
        p = subprocess.run([str(VLLM_PY), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, env={**os.environ, **VLLM_ENV})
        v["vllm"] = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else "?"
    return v


def cpu_kind() -> str:
    """What the CPU's vector units offer kvserve's kernels: "AVX-512 BF16", "AVX-512" or "AVX2"."""
    from kvserve import kernels
    flags = kernels._cpu_id().split()
    return "AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or "?"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def machine() -> str:
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // (1024 * 1024)
    except (OSError, ValueError):
        mem = 0
    return f"{cpu_name()}, {os.cpu_count()} cores, {mem} GiB RAM, {platform.system()} {platform.release()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["offline", "serve"], default=None)
    p.add_argument("--s1-runs", type=int, default=3, help="S1 runs per engine; the median-throughput one is reported")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md and the plots")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    DOCS.mkdir(exist_ok=True)
    os.chdir(ROOT)
    has_vllm = not args.skip_vllm and vllm_available() and ensure_hf_model()
    args.skip_vllm = not has_vllm
    previous = RESULTS / "compare.json"
    results = json.loads(previous.read_text()) if args.only and previous.exists() else {}
    results.update({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "versions": versions(),
                    "load_before": load_avg()})
    # with --only, the other part comes from an earlier run: each part keeps the command and date that made it
    made = {"command": " ".join(["python benchmarks/compare.py", *sys.argv[1:]]), "date": results["date"]}
    provenance = results.setdefault("provenance", {})
    if args.only in (None, "offline"):
        results["num_prompts"] = args.num_prompts
    with tempfile.TemporaryDirectory(prefix="kvserve-compare-") as t:
        tmp = Path(t)
        if args.only in (None, "offline"):
            work_path = RESULTS / "w1_workload.json"
            make_workload(work_path, args.num_prompts, args.seed)
            off = {"kvserve": kvserve_offline(args, work_path, tmp)}
            if not args.skip_vllm:
                off["vllm"] = vllm_offline(args, work_path, tmp)
            if not args.skip_hf:
                off["transformers"] = hf_offline(args, work_path, tmp)
            results["offline"], provenance["offline"] = off, made
        if args.only in (None, "serve"):
            if not has_vllm:
                log("the serving comparison needs `vllm bench serve` as its client: skipped")
            else:
                results["serve"], provenance["serve"] = serve_all(args, tmp), made
    results["load_after"] = load_avg()
    (RESULTS / "compare.json").write_text(json.dumps(results, indent=2))
    log(f"wrote {RESULTS / 'compare.json'}")
    if not args.no_doc:
        write_doc(report(results, plot(results)))
        log(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
