"""Two builds of the packed bf16 matmul that widens the weights (kvserve/csrc, e.g. a worktree of the commit before)
alternating in one process, on a pass over the bundled model's 30 layers of linears (q/k/v, o, gate/up, down), so
that W comes from DRAM as in the engine. Prints the best ms of a pass per number of rows and the ratio A / B.

  python benchmarks/widen_gemm_ab.py OLD_TREE/kvserve/csrc kvserve/csrc [--variant no-avx512] [--rows 16 64 256]

--variant: no-avx512 (what an AVX2 CPU builds) or no-avx512bf16 (an AVX-512 CPU without BF16); the native build
where this CPU has neither AVX-512 nor its BF16. The two builds must give the same bits: the script checks it.
"""
from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

from kvserve import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # SmolLM2-135M's linears: (out, in)


def build(csrc: Path, variant: str) -> ctypes.CDLL:
    flags = kernels.VARIANTS[kernels.build_of(variant)]
    lib = kernels._bind(ctypes.CDLL(str(kernels._build(kernels._compiler(), kernels._read_source(csrc), flags))))
    if lib.kvserve_packed_matmul_kind() != 2:
        raise SystemExit(f"{csrc}: the {variant} build does not widen bf16 weights on this CPU")
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--variant", default="no-avx512", choices=["no-avx512", "no-avx512bf16"])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    libs = {"A": build(args.a, args.variant), "B": build(args.b, args.variant)}
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(30):
        for n, k in SHAPES:
            wp = torch.empty(kernels.packed_numel(n, k), dtype=torch.bfloat16)
            kernels.pack_weight(libs["B"], torch.randn(n, k, generator=g).to(torch.bfloat16), wp)
            layers.append((n, k, wp))
    xs = {k: torch.randn(max(args.rows), k, generator=g).to(torch.bfloat16) for _, k in SHAPES}
    ys = {name: {n: torch.empty(max(args.rows), n, dtype=torch.bfloat16) for n, _ in SHAPES} for name in libs}

    def run(name: str, m: int) -> None:
        for n, k, wp in layers:
            libs[name].kvserve_packed_matmul_bf16(xs[k].data_ptr(), k, wp.data_ptr(), ys[name][n].data_ptr(), n, m,
                                                  n, k)

    print(f"{'rows':>6} {'A ms':>9} {'B ms':>9} {'A / B':>6}")
    for m in args.rows:
        best = {name: float("inf") for name in libs}
        for _ in range(args.repeats):
            for name in libs:
                t = time.perf_counter()
                run(name, m)
                best[name] = min(best[name], time.perf_counter() - t)
        same = all(torch.equal(ys["A"][n][:m], ys["B"][n][:m]) for n, _ in SHAPES)
        print(f"{m:6d} {best['A'] * 1e3:9.2f} {best['B'] * 1e3:9.2f} {best['A'] / best['B']:6.3f}"
              + ("" if same else "  (the builds' results differ)"))


if __name__ == "__main__":
    main()
