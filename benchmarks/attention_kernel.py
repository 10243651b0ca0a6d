"""The C++ paged-attention kernels on W1-shaped steps, side by side in one process: the bf16 tile kernel
(vdpbf16ps for QK^T and PV) against the previous AVX-512 kernel (built with -DKV_NO_BF16_TILE) and the torch
reference backend. SmolLM2-135M shapes: 9 q heads, 3 kv heads, head dim 64, blocks of 16.

  python benchmarks/attention_kernel.py [--repeats 20] [--num-threads N]

Steps: "decode 64" (64 sequences, one new token each, contexts 64..768 as in W1), "decode 1" (one sequence,
context 400), "prefill" (4 fresh prompts of 128..512 tokens). Each call is one layer's attention; the table shows
the best ms per call, the ratio to the previous kernel, and for decode the KV bytes read per second.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvserve.attention import CpuPagedAttention, TorchPagedAttention, build_attention_metadata, cpu_kernels

H, HKV, D, BS = 9, 3, 64, 16


def make_step(query_lens: list[int], seq_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [-(-s // BS) for s in seq_lens]
    perm = rng.permutation(sum(need)).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    k_cache, v_cache = (torch.randn(sum(need), BS, HKV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    t = sum(query_lens)
    q = torch.randn(t, H * D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(t, HKV * D, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v, k_cache, v_cache, build_attention_metadata(query_lens, seq_lens, tables, BS)


def time_backend(backend, step, repeats: int) -> tuple[float, torch.Tensor]:
    q, k, v, k_cache, v_cache, meta = step
    out = backend.forward(q, k, v, k_cache, v_cache, meta, H, D ** -0.5)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend.forward(q, k, v, k_cache, v_cache, meta, H, D ** -0.5)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    rng = np.random.default_rng(0)
    ctx = rng.integers(64, 769, size=64).tolist()
    prompts = rng.integers(128, 513, size=4).tolist()
    steps = {"decode 64": make_step([1] * 64, ctx), "decode 1": make_step([1], [400]),
             "prefill": make_step(prompts, prompts)}
    backends = {"bf16 tile": CpuPagedAttention(),
                "previous": CpuPagedAttention(cpu_kernels.load(extra_flags=("-DKV_NO_BF16_TILE",))),
                "torch": TorchPagedAttention()}
    print(f"{'step':<10} {'backend':<10} {'ms/call':>8} {'vs previous':>11} {'KV GB/s':>8} {'max |err|':>9}")
    for name, step in steps.items():
        kv_bytes = sum(step[5].seq_lens) * HKV * D * 2 * 2
        times, outs = {}, {}
        for bname, backend in backends.items():
            times[bname], outs[bname] = time_backend(backend, step, args.repeats)
        for bname in backends:
            gbs = kv_bytes / times[bname] / 1e6 if name.startswith("decode") else float("nan")
            err = (outs[bname].float() - outs["torch"].float()).abs().max().item()
            print(f"{name:<10} {bname:<10} {times[bname]:8.3f} {times['previous'] / times[bname]:10.2f}x "
                  f"{gbs:8.1f} {err:9.4f}")


if __name__ == "__main__":
    main()
