"""The skinny bf16 matmul (kvserve/csrc/gemv.cpp) against oneDNN's packed path, side by side in one process,
over 30 layers of SmolLM2-135M-shaped weights (qkv, o, gate|up, down) for decode steps of M rows.

  python benchmarks/skinny_matmul.py [--num-threads N] [--rows 1,2,4,6,8,10,12,16]

Prints the best of 5 passes over all 120 weights for each path and the ratio. The engine takes the skinny path
up to `kv_gemv_max_rows()` rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from kvserve.attention import cpu_kernels
from kvserve.model.layers import packed_linear, prepack_weights

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--rows", default="1,2,4,6,8,10,12,16")
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    lib = cpu_kernels.load()
    if lib is None or lib.kv_gemv_max_rows() == 0:
        raise SystemExit("the skinny kernel needs a C++ compiler and a CPU with AVX-512 BF16")
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(30) for n, k in SHAPES]
    packs = prepack_weights(weights)
    # the engine's own call, forced onto one path or the other (the kernel takes up to 16 rows)
    paths = {"onednn": [dataclasses.replace(p, skinny=None) for p in packs],
             "skinny": [dataclasses.replace(p, skinny_rows=16) for p in packs]}
    print(f"threads {torch.get_num_threads()}, engine cut at {lib.kv_gemv_max_rows()} rows")
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (576, 1536)}
        best = {"onednn": float("inf"), "skinny": float("inf")}
        for _ in range(5):
            for name in best:
                t0 = time.perf_counter()
                for w, pack in zip(weights, paths[name]):
                    packed_linear(xs[w.shape[1]], pack)
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"M={m:3d}  oneDNN {best['onednn'] * 1e3:7.2f} ms  skinny {best['skinny'] * 1e3:7.2f} ms  "
              f"{best['onednn'] / best['skinny']:.2f}x")


if __name__ == "__main__":
    main()
