"""The engine's bf16 matmuls (kvserve/csrc/gemv.cpp: a GEMV up to 8 rows, register-tiled GEMM beyond) against
oneDNN's packed path (torch's fastest bf16 linear on the CPU), side by side in one process, on SmolLM2-135M's
shapes for steps of M rows.

  python benchmarks/matmul.py [--num-threads N] [--rows 1,4,8,12,16,32,64,128,256,1024]

For each M: the best of 5 passes over 30 layers' qkv, o, gate|up and down weights (120 matmuls), and over the
tied LM head (49152 x 576), for both paths, with GFLOP/s and the ratio. The engine takes the C++ kernels
wherever they build (AVX-512 BF16), oneDNN elsewhere.
"""
from __future__ import annotations

import argparse
import time

import torch

from kvserve import kernels
from kvserve.model.linear_method import prepack_weights

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def best_of(fn, passes: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--rows", default="1,4,8,12,16,32,64,128,256,1024")
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    lib = kernels.load()
    if lib is None or not lib.kvserve_has_packed_matmul():
        raise SystemExit("the C++ matmul kernels need a C++ compiler and a CPU with AVX-512 BF16")
    sets = {"layers": [torch.randn(n, k).to(torch.bfloat16) for _ in range(30) for n, k in LAYER_SHAPES],
            "lm head": [torch.randn(*LM_HEAD).to(torch.bfloat16)]}
    print(f"threads {torch.get_num_threads()}")
    print(f"{'M':>4} {'weights':<8} {'oneDNN ms':>9} {'GFLOP/s':>7} {'kvserve ms':>10} {'GFLOP/s':>7} {'ratio':>6}")
    for name, weights in sets.items():
        # the engine's own call on either packing
        paths = {"onednn": prepack_weights(weights, onednn=True), "kernel": prepack_weights(weights)}
        for m in map(int, args.rows.split(",")):
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}
            flop = sum(2 * m * w.shape[0] * w.shape[1] for w in weights)
            t = {path: best_of(lambda: [pk.apply(None, xs[w.shape[1]]) for w, pk in zip(weights, pp)])
                 for path, pp in paths.items()}
            print(f"{m:4d} {name:<8} {t['onednn'] * 1e3:9.2f} {flop / t['onednn'] / 1e9:7.0f} "
                  f"{t['kernel'] * 1e3:10.2f} {flop / t['kernel'] / 1e9:7.0f} {t['onednn'] / t['kernel']:5.2f}x")


if __name__ == "__main__":
    main()
