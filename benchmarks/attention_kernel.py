"""The C++ paged-attention kernels on W1-shaped steps, side by side in one process: the bf16 kernel over the
tiled KV layout (kvserve/attention/kv_layout.py: K and V tiles vdpbf16ps takes, read straight from the cache)
against the AVX-512 kernel over the standard layout [blocks, block size, kv heads, head dim] (what bf16 pools
that cannot tile take), the kernel over FP8 (E4M3) pools of the same values, and the torch reference backend.
SmolLM2-135M shapes: 9 q heads, 3 kv heads, head dim 64, blocks of 16.

  python benchmarks/attention_kernel.py [--repeats 20] [--num-threads N] [--layers 30]

Steps: "decode 64" (64 sequences, one new token each, contexts 64..768 as in W1), "decode 1" (one sequence,
context 400), "verify 6" (one sequence verifying 5 drafts: 6 query tokens, context 400), "prefill" (4 fresh
prompts of 128..512 tokens). Each call is one layer's attention, and the calls
cycle over --layers layers' pools, so with 30 (the model's) the K/V come from DRAM as in the engine, with 1 from
the caches. The table shows the best ms per call, the ratio to the standard layout's kernel, for decode the KV
bytes read per second, and the largest difference from the torch backend's output (for FP8, torch over the same
FP8 pools).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvserve.attention import CpuPagedAttention, TorchPagedAttention, build_attention_metadata, kv_layout

H, HKV, D, BS = 9, 3, 64, 16


def make_step(query_lens: list[int], seq_lens: list[int], layers: int, seed: int = 0):
    """(q, k, v, metadata, pools): the pools of each layer in both layouts, with the same content, scattered."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [-(-s // BS) for s in seq_lens]
    perm = rng.permutation(sum(need)).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    pools = {"standard": [], "tiled": [], "fp8": []}
    slots = torch.arange(sum(need) * BS)
    for _ in range(layers):
        k_cache, v_cache = (torch.randn(sum(need), BS, HKV, D, generator=g).to(torch.bfloat16) for _ in range(2))
        pools["standard"].append((k_cache, v_cache))
        pools["fp8"].append((k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)))
        shapes = kv_layout.cache_shapes(sum(need), BS, HKV, D, tiled=True)
        tiled = tuple(torch.empty(shape, dtype=torch.bfloat16) for shape in shapes)
        kv_layout.write_slots(*tiled, slots, k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D))
        pools["tiled"].append(tiled)
    t = sum(query_lens)
    q = torch.randn(t, H * D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(t, HKV * D, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v, build_attention_metadata(query_lens, seq_lens, tables, BS), pools


def time_backend(backend, step, layout: str, repeats: int) -> tuple[float, torch.Tensor]:
    """Best ms per layer over `repeats` passes over all layers, and the first layer's output."""
    q, k, v, meta, pools = step
    scales = torch.ones(2) if layout == "fp8" else None
    out = backend.forward(q, k, v, *pools[layout][0], meta, H, D ** -0.5, scales)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k_cache, v_cache in pools[layout]:
            backend.forward(q, k, v, k_cache, v_cache, meta, H, D ** -0.5, scales)
        best = min(best, (time.perf_counter() - t0) / len(pools[layout]))
    return best * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--layers", type=int, default=30, help="pools cycled through (30: from DRAM; 1: from caches)")
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    rng = np.random.default_rng(0)
    ctx = rng.integers(64, 769, size=64).tolist()
    prompts = rng.integers(128, 513, size=4).tolist()
    steps = {"decode 64": make_step([1] * 64, ctx, args.layers), "decode 1": make_step([1], [400], args.layers),
             "verify 6": make_step([6], [400], args.layers),
             "prefill": make_step(prompts, prompts, min(args.layers, 4))}
    cpu = CpuPagedAttention()
    runs = {"tiled": (cpu, "tiled"), "standard": (cpu, "standard"), "fp8": (cpu, "fp8"),
            "torch": (TorchPagedAttention(), "standard")}
    print(f"{'step':<10} {'kernel':<10} {'ms/layer':>8} {'vs standard':>11} {'KV GB/s':>8} {'max |err|':>9}")
    for name, step in steps.items():
        kv_values = sum(step[3].seq_lens) * HKV * D * 2
        times, outs = {}, {}
        for rname, (backend, layout) in runs.items():
            times[rname], outs[rname] = time_backend(backend, step, layout, args.repeats)
        # FP8 against torch over the same FP8 pools (a pass of the torch backend there, not timed)
        ref = {rname: outs["torch"] for rname in runs}
        ref["fp8"] = time_backend(TorchPagedAttention(), step, "fp8", 0)[1]
        for rname in runs:
            kv_bytes = kv_values * (1 if rname == "fp8" else 2)
            gbs = kv_bytes / times[rname] / 1e6 if name.startswith("decode") else float("nan")
            err = (outs[rname].float() - ref[rname].float()).abs().max().item()
            print(f"{name:<10} {rname:<10} {times[rname]:8.3f} {times['standard'] / times[rname]:10.2f}x "
                  f"{gbs:8.1f} {err:9.4f}")


if __name__ == "__main__":
    main()
