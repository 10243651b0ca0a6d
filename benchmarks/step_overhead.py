"""The host's share of a decode step: where a step's time goes outside the model, at batch 64.

  python benchmarks/step_overhead.py [--baseline OTHER_CHECKOUT] [--requests 64] [--steps 64] [--rounds 3]
                                     [--async-scheduling] [--final-only] [--profile] [--json PATH]

A random-weight Llama with the bundled model's vocabulary (49,152) but one layer of width 64, so that the forward
costs next to nothing and what is left of a step is the engine around it: scheduling, building the step's inputs,
the logits and sampling, merging the sampled tokens, detokenizing and building the outputs. On a GPU these run on
the host while the device waits (benchmarks/gpu_check.py's decode step at batch 64 is bound by them), so they are
measured here, on the CPU, as milliseconds a step (medians; "host" is the step less the forward and the logits,
plus the attention metadata the forward builds on the host), beside a baseline run side by side: `--baseline DIR`
runs a second checkout's kvserve on the same model, each round in processes of their own, alternating.

`--async-scheduling` runs this tree's engine with it (each step launched behind the one in flight; the CPU still
computes it in the host's thread, so this measures the host's work a step under async scheduling, not an overlap).
`--final-only`: the requests' outputs are FINAL_ONLY (LLM.generate's, the GPU check's W1) instead of the server's DELTA
streams. `--profile` prints cProfile's table of the measured steps (by cumulative time; SORT=tottime by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PARTS = (("schedule", "scheduler", "schedule"), ("inputs", "runner", "prepare_inputs"),
         ("forward", "runner", "run_forward"), ("metadata", "runner module", "build_group_metadata"),
         ("logits", "model", "compute_logits"), ("sample", "runner", "_sample"),
         ("update", "scheduler", "update_from_output"), ("outputs", "processor", "process"))


def make_model(root: Path) -> Path:
    """A one-layer random Llama with SmolLM2's vocabulary (its tokenizer is the bundled model's)."""
    import torch
    import transformers
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = root / "tiny-vocab49152"
    model.save_pretrained(str(path))
    return path


def wrap(engine, timings: dict) -> None:
    """Time each part of a step by wrapping the bound method on its object (behaviour unchanged)."""
    for label, owner, name in PARTS:
        obj = (engine.runner.model if owner == "model" else sys.modules[type(engine.runner).__module__]
               if owner == "runner module" else getattr(engine, owner))
        inner = getattr(obj, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            t = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                timings[_label] = timings.get(_label, 0.0) + time.perf_counter() - t
        setattr(obj, name, timed)


def measure(model: Path, requests: int, steps: int, profile: bool, final_only: bool = False, **engine_kwargs) -> dict:
    import numpy as np
    from kvserve import LLM, SamplingParams
    from kvserve.model.loader import default_model_path
    from kvserve.sampling_params import RequestOutputKind
    llm = LLM(model=str(model), tokenizer=default_model_path(), dtype="float32", max_num_seqs=requests,
              max_model_len=1024, **engine_kwargs)
    engine = llm.llm_engine
    rng = np.random.default_rng(1)
    for i in range(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(3, 49152, 256).tolist()},
                           SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY if final_only
                                          else RequestOutputKind.DELTA))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    timings: dict[str, float] = {}
    wrap(engine, timings)
    prof = cProfile.Profile() if profile else None
    samples: dict[str, list[float]] = {"step": []}
    for _ in range(steps):
        before = dict(timings)
        if prof:
            prof.enable()
        t = time.perf_counter()
        engine.step()
        samples["step"].append(time.perf_counter() - t)
        if prof:
            prof.disable()
        for label, _, _ in PARTS:
            samples.setdefault(label, []).append(timings.get(label, 0.0) - before.get(label, 0.0))
    if prof:
        pstats.Stats(prof, stream=sys.stderr).sort_stats(os.environ.get("SORT", "cumulative")).print_stats(45)
    result = {f"{k}_ms": 1e3 * statistics.median(v) for k, v in samples.items()}
    # the forward's attention metadata is built on the host, in the forward's time
    result["host_ms"] = result["step_ms"] - result["forward_ms"] - result["logits_ms"] + result["metadata_ms"]
    return result


def child(args) -> dict:
    """Run measure() in a process of its own with `python_path` first on sys.path; returns its figures."""
    code = ("import json, sys; sys.path.insert(0, {!r}); sys.path.insert(1, {!r}); import step_overhead as s; "
            "print('RESULT' + json.dumps(s.measure(s.Path({!r}), {}, {}, False, **{!r})))").format(
        args[0], str(ROOT / "benchmarks"), args[1], args[2], args[3], args[4] if len(args) > 4 else {})
    env = {**os.environ, "PYTHONPATH": args[0]}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[6:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="another checkout's root: its kvserve measured alternately, side by side")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "step_overhead.json"))
    p.add_argument("--async-scheduling", action="store_true",
                   help="this tree's engine with async scheduling (on the CPU each step still runs in the host's "
                        "thread: what it measures is the host's work a step, which a GPU overlaps with its own)")
    p.add_argument("--final-only", action="store_true",
                   help="the requests' outputs FINAL_ONLY instead of DELTA (both trees)")
    args = p.parse_args()
    kind = {"final_only": True} if args.final_only else {}
    this = {**kind, "async_scheduling": True} if args.async_scheduling else kind
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        if args.profile:
            print(json.dumps(measure(model, args.requests, args.steps, True, **this), indent=1))
            return
        runs: dict[str, list[dict]] = {"this tree": [], "baseline": []}
        for _ in range(args.rounds):
            runs["this tree"].append(child([str(ROOT), str(model), args.requests, args.steps, this]))
            if args.baseline:
                runs["baseline"].append(child([args.baseline, str(model), args.requests, args.steps, kind]))
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items() if rs}
    keys = list(next(iter(rows.values())))
    print("| ms a step, batch %d | " % args.requests + " | ".join(rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for k in keys:
        print(f"| {k[:-3]} | " + " | ".join(f"{r[k]:.3f}" for r in rows.values()) + " |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "requests": args.requests,
                                           "command": " ".join(["python", *sys.argv]), "medians": rows,
                                           "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
