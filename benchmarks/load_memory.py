"""Resident memory while an engine starts: the resident set sampled every 50 ms from /proc/self/status while
`LLM(model, kv_cache_memory=...)` is built, its peak, and where it ends once started (Linux).

    python benchmarks/load_memory.py [MODEL] [--kv-cache-memory 256MiB] [--quantization auto]

MODEL: a GGUF file or HF directory (default: the bundled SmolLM2). Prints the start time, the resident set once
started, the peak and when it was reached, and the resident set over time (seconds:MiB). Then what the engine
added to the process (the resident set once started and at its peak, less the process's with torch, kvserve and
transformers' tokenizer classes imported: the runtime, the same whatever the model) against the model's files. The KV pool is not in these figures:
its pages become resident as blocks are first written, one for one, and none are at start.
"""
from __future__ import annotations

import argparse
import importlib
import resource
import threading
import time
from pathlib import Path


def resident_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--quantization", default="auto")
    args = p.parse_args()
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.perf_counter(), resident_mib()))
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    importlib.import_module("transformers.tokenization_utils_fast")   # the tokenizers' library: every engine's

    from kvserve import LLM
    from kvserve.model.loader import resolve_model_path
    runtime = resident_mib()
    llm = LLM(model=args.model, kv_cache_memory=args.kv_cache_memory, quantization=args.quantization)
    started = time.perf_counter() - t0
    time.sleep(0.2)
    done.set()
    at, peak = max(samples, key=lambda s: s[1])
    print(f"started in {started:.1f} s; resident {resident_mib()} MiB once started; peak {peak} MiB at "
          f"{at - t0:.1f} s (ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB)")
    step = max(1, len(samples) // 30)
    print(" ".join(f"{t - t0:.1f}:{m}" for t, m in samples[::step]))
    path = Path(resolve_model_path(args.model))
    files = [path] if path.is_file() else [*path.glob("*.safetensors"), *path.glob("tokenizer*.json")]
    size = sum(f.stat().st_size for f in files) >> 20
    rusage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"the runtime (torch, kvserve, transformers' tokenizers imported) {runtime} MiB; the engine added {resident_mib() - runtime} MiB once "
          f"started, {rusage - runtime} MiB at its peak: {(resident_mib() - runtime) / size:.2f}x and "
          f"{(rusage - runtime) / size:.2f}x its model's files ({size} MiB: {', '.join(f.name for f in files)})")
    del llm


if __name__ == "__main__":
    main()
