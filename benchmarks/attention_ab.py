"""Two builds of the C++ attention kernels (two copies of kvserve/csrc, e.g. a worktree of the commit before)
alternating in one process on decode steps of one attention shape, K/V streamed from DRAM (enough layers' pools
cycled): one sequence decoding at contexts of 1,000 to 16,000 keys, two sequences, and a batch of 64 (contexts
64-768, as in W1), and 4 prompts' prefill. Prints the best ms per layer of each build, the ratio A / B and whether
their outputs have the same bits.

  python benchmarks/attention_ab.py OLD_TREE/kvserve/csrc kvserve/csrc [--variant native|no-avx512]
                                    [--layout standard|tiled] [--heads 9 --kv-heads 3 --head-dim 64]

--variant no-avx512 runs what an AVX2 CPU builds; --layout tiled the bf16 tile kernel (AVX-512 BF16 CPUs).
"""
from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import numpy as np
import torch

import attention_kernel as ak
from kvserve import kernels


def build(csrc: Path, variant: str) -> ctypes.CDLL:
    flags = kernels.VARIANTS[kernels.build_of(variant)]
    return kernels._bind(ctypes.CDLL(str(kernels._build(kernels._compiler(), kernels._read_source(csrc), flags))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--variant", default="native", choices=["native", "no-avx512", "no-avx512bf16"])
    p.add_argument("--layout", default="standard", choices=["standard", "tiled"])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args()
    ak.H, ak.HKV, ak.D = args.heads, args.kv_heads, args.head_dim   # make_step's shapes
    libs = {"A": build(args.a, args.variant), "B": build(args.b, args.variant)}
    if args.layout == "tiled" and not all(lib.kvserve_bf16_tiles() for lib in libs.values()):
        raise SystemExit("the tiled layout needs AVX-512 BF16 (a native build on such a CPU)")
    rng = np.random.default_rng(0)
    row_bytes = args.kv_heads * args.head_dim * 2 * 2   # K and V of a position, bf16
    steps = {f"decode 1 @{n}": ([1], [n]) for n in (1000, 4000, 16000)}
    steps["decode 2 @3000"] = ([1, 1], [3000, 1500])
    steps["decode 64"] = ([1] * 64, rng.integers(64, 769, 64).tolist())
    prompts = rng.integers(128, 513, 4).tolist()
    steps["prefill 4"] = (prompts, prompts)
    print(f"{args.variant} {args.layout}, {args.heads} heads / {args.kv_heads} kv heads, head dim {args.head_dim}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'step':<16} {'A ms':>8} {'B ms':>8} {'A / B':>6} same bits")
    for name, (query_lens, seq_lens) in steps.items():
        layers = max(2, min(30, int(4e8 // (sum(seq_lens) * row_bytes))))   # pools well past the caches
        q, k, v, meta, pools = ak.make_step(query_lens, seq_lens, layers)
        best, outs = {n: float("inf") for n in libs}, {}
        for _ in range(args.repeats):
            for n, lib in libs.items():
                out = torch.empty_like(q)
                t = time.perf_counter()
                for k_cache, v_cache in pools[args.layout]:
                    kernels.paged_attention(lib, q, k_cache, v_cache, out, meta.kernel_args, args.heads,
                                            args.head_dim ** -0.5)
                best[n] = min(best[n], (time.perf_counter() - t) / len(pools[args.layout]))
                outs[n] = out
        print(f"{name:<16} {best['A'] * 1e3:8.3f} {best['B'] * 1e3:8.3f} {best['A'] / best['B']:6.2f} "
              f"{torch.equal(outs['A'], outs['B'])}", flush=True)


if __name__ == "__main__":
    main()
