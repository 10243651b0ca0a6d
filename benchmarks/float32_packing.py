"""float32 linears on oneDNN-prepacked weights (the engine's default on the CPU) against torch's F.linear on the
plain weights, side by side in one engine: the configurations alternate, the medians are compared.

  python benchmarks/float32_packing.py [--model PATH] [--repeats 3]

Per configuration: single-stream TPOT (one request, 64 greedy tokens after a 32-token prompt, prefill time
subtracted via a max_tokens=1 run), a decode batch of 8 (ms per step), and a 512-token prefill (ms). The bundled
SmolLM2-135M by default; `--model` takes a GGUF or HF directory (`make models` fetches Qwen2.5-Coder 1.5B).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.layers import Linear, restore_unpacked_weights
from kvserve.model.linear_method import DENSE

PROMPT = list(range(1000, 1032))


def switch(model, packs: dict, on: bool) -> None:
    for m, pack in packs.items():
        if m == "lm_head":
            model.tied_head = pack if on else DENSE
        else:
            m.method = pack if on else DENSE


def timed(llm: LLM, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def measure(llm: LLM) -> dict:
    one = [{"prompt_token_ids": PROMPT}]
    tpot = (timed(llm, one, 64) - timed(llm, one, 1)) / 63
    eight = [{"prompt_token_ids": [t + i for t in PROMPT]} for i in range(8)]
    batch = (timed(llm, eight, 33) - timed(llm, eight, 1)) / 32
    prefill = timed(llm, [{"prompt_token_ids": list(range(2000, 2512))}], 1)
    return {"single-stream TPOT ms": tpot * 1e3, "batch-8 step ms": batch * 1e3, "512-token prefill ms": prefill * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llm = LLM(model=args.model, dtype="float32", enable_prefix_caching=False, max_model_len=2048, quantization="none")
    model = llm.llm_engine.model
    restore_unpacked_weights(model)   # F.linear needs the plain weights back
    packs = {m: m.method for m in model.modules() if isinstance(m, Linear) and m.method is not DENSE}
    packs["lm_head"] = model.tied_head
    runs = {"F.linear (MKL)": [], "oneDNN packed": []}
    timed(llm, [{"prompt_token_ids": PROMPT}], 8)   # warm-up
    for _ in range(args.repeats):
        for name, on in (("F.linear (MKL)", False), ("oneDNN packed", True)):
            switch(model, packs, on)
            runs[name].append(measure(llm))
    keys = list(runs["oneDNN packed"][0])
    print(f"{args.model or 'SmolLM2-135M (bundled)'}, float32, {torch.get_num_threads()} threads, median of "
          f"{args.repeats}\n")
    print("| figure | F.linear (MKL) | oneDNN packed | speed-up |\n|---|---:|---:|---:|")
    for k in keys:
        base, new = (statistics.median(r[k] for r in runs[n]) for n in runs)
        print(f"| {k} | {base:.1f} | {new:.1f} | {base / new:.2f}× |")


if __name__ == "__main__":
    main()
