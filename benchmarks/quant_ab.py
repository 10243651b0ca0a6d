"""Two builds of the quantized matmul kernels side by side: each call on another copy of the weight, so that it
streams from memory as in a decode step (--copies 1: the weights stay in cache), the builds alternating in one
process so that the machine's drift hits both alike.

  python benchmarks/quant_ab.py DIR_A DIR_B [--rows 1,2,4,8] [--copies 24] [--reps 8]
                                [--weights qwen1.5b:blk.0.ffn_down.weight,smollm2:blk.0.ffn_up.weight]

DIR_A and DIR_B hold kvserve/csrc's files (the one before a change: `git worktree add /tmp/old HEAD~1`, then
/tmp/old/kvserve/csrc). The weights are real tensors of the bundled SmolLM2 and the Qwen2.5-Coder GGUFs
(`make models`): model one of smollm2, qwen0.5b, qwen1.5b. Prints each build's best time per call at each row
count and A / B (> 1: B is faster).
"""
from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from kvserve import kernels
from kvserve.model.fetch import model_path
from kvserve.model.loader import default_model_path
from kvserve.model.quantization import QuantizedTensor, QuantizedWeight

MODELS = {"smollm2": default_model_path, "qwen0.5b": lambda: model_path("qwen2.5-coder-0.5b"),
          "qwen1.5b": lambda: model_path("qwen2.5-coder-1.5b")}
DEFAULT_WEIGHTS = ("qwen1.5b:blk.0.ffn_up.weight,qwen1.5b:blk.0.ffn_down.weight,qwen1.5b:blk.11.ffn_down.weight,"
                   "qwen0.5b:blk.0.ffn_up.weight,smollm2:blk.0.ffn_up.weight")


def build(csrc: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(kernels._build(kernels._compiler(), kernels._read_source(Path(csrc)))))
    lib.kvserve_quant_matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 2 + \
        [ctypes.c_void_p] + [ctypes.c_int64] * 3
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir_a")
    ap.add_argument("dir_b")
    ap.add_argument("--rows", default="1,2,4,8", help="rows of activations, comma-separated")
    ap.add_argument("--copies", type=int, default=24, help="copies of each weight, at most 400 MB of them")
    ap.add_argument("--reps", type=int, default=8, help="passes over the copies; the best one counts")
    ap.add_argument("--weights", default=DEFAULT_WEIGHTS, help="model:tensor, comma-separated")
    args = ap.parse_args()
    libs = [build(args.dir_a), build(args.dir_b)]
    rows = [int(r) for r in args.rows.split(",")]
    for spec in args.weights.split(","):
        model, name = spec.rsplit(":", 1)
        t = next(t for t in gguf.GGUFReader(str(MODELS[model]() if model in MODELS else model)).tensors
                 if t.name == name)
        cols, n = int(t.shape[0]), int(t.shape[1])
        raw = torch.from_numpy(np.array(t.data).reshape(n, -1).copy())
        copies = max(2, min(args.copies, int(400e6 // raw.numel())))   # 2 at least: never the same copy twice
        ws = [QuantizedWeight([QuantizedTensor(int(t.tensor_type), raw.clone(), cols)]) for _ in range(copies)]
        line = []
        for m in rows:
            x = torch.randn(m, cols, dtype=torch.bfloat16)
            y = torch.empty(m, n, dtype=torch.bfloat16)
            best = [float("inf")] * 2
            for rep in range(args.reps):
                for i in ((0, 1) if rep % 2 == 0 else (1, 0)):
                    t0 = time.perf_counter()
                    for w in ws:
                        libs[i].kvserve_quant_matmul(w.desc_ptr, x.data_ptr(), cols, 1, y.data_ptr(), n, m, cols)
                    best[i] = min(best[i], (time.perf_counter() - t0) / len(ws))
            line.append(f"{m}: {best[0] * 1e6:.1f} / {best[1] * 1e6:.1f} us, {best[0] / best[1]:.2f}x")
        print(f"{model} {name} {t.tensor_type.name} {n}x{cols} x{copies} | " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
