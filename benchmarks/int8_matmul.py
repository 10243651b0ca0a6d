"""`--quantization int8`'s matmul (INT8: int8 per output channel, kvserve/csrc/quant_int8.cpp) against the Q8_0
kernels (blocks of 32) and the dense linear the engine would otherwise run on this CPU (the bf16 kernels where
AVX-512 BF16 builds them, else oneDNN in float32), side by side in one process on the same random weights, on
Qwen2.5-Coder-1.5B's MLP shapes, for steps of M rows.

  python benchmarks/int8_matmul.py [--rows 1,8,64,256] [--num-threads N]

Each figure is the best of 5 calls (ms); the ratios are the dense path's time and Q8_0's over INT8's. The int8
kernels take bf16 activations, as the engine gives them wherever its fused stack runs.
"""
from __future__ import annotations

import argparse

import torch
from matmul import best_of   # benchmarks/matmul.py, beside this script

from kvserve import kernels
from kvserve.model.linear_method import prepack_weights
from kvserve.model.quantization import QuantizedWeight, quantize_int8, quantize_q8_0, quantized_matmul

SHAPES = [(8960, 1536), (1536, 8960)]   # gate|up halves and down of Qwen2.5-Coder-1.5B


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,64,256")
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        int8, q8 = QuantizedWeight([quantize_int8(w)]), QuantizedWeight([quantize_q8_0(w)])
        lib = kernels.load()
        dense_dtype = torch.bfloat16 if lib is not None and lib.kvserve_has_packed_matmul() else torch.float32
        dense = prepack_weights([w.to(dense_dtype)])[0]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            xb, xd = x.bfloat16(), x.to(dense_dtype)
            t8 = best_of(lambda: quantized_matmul(xb, int8)) * 1e3
            tq = best_of(lambda: quantized_matmul(xb, q8)) * 1e3
            td = best_of(lambda: dense.apply(None, xd)) * 1e3
            gmac = m * n * k / t8 / 1e6
            print(f"{n}x{k} M={m:4d}  INT8 {t8:8.2f} ms ({gmac:6.1f} GMAC/s)  Q8_0 {tq:8.2f} ms ({tq / t8:4.2f}x)  "
                  f"dense {str(dense_dtype).removeprefix('torch.')} {td:8.2f} ms ({td / t8:4.2f}x)")


if __name__ == "__main__":
    main()
