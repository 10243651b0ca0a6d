"""What a decode step's forward launches on a GPU, counted on the CPU (tests/gpu_step_ops.py: the GPU's ops on CPU
tensors, Triton under its interpreter). A captured decode graph replays one kernel per launch, and on small models
their number, not the bytes they read, sets the step's time: each layer is 4 matmuls (q|k|v, o, gate|up, down) and 6
Triton kernels (RMSNorm with its residual add twice, RoPE on q|k in place, the KV write, the attention, SiLU·mul),
and the rest of the forward the embedding, the RoPE tables' gather and the final norm. An op more per layer (a
copy, a cast, an op the Triton kernels should have taken) fails here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent / "gpu_step_ops.py"
LAYER_TRITON = {"rmsnorm_kernel": 2, "rope_kernel": 1, "write_kv_kernel": 1, "unified_attention_kernel": 1,
                "silu_mul_kernel": 1}
MATMULS = {"mm.default", "addmm.default", "_linear_pointwise.default", "linear.default"}   # CUDA's, the CPU's


def test_a_decode_forward_launches_ten_kernels_a_layer_and_six_besides(tmp_path):
    env = {**os.environ, "KVSERVE_KERNELS": "none", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])["layers"]
    two, three = ({kind: Counter(counts[n][kind]) for kind in ("torch", "triton")} for n in ("2", "3"))
    layer = {kind: three[kind] - two[kind] for kind in ("torch", "triton")}
    assert dict(layer["triton"]) == LAYER_TRITON
    assert sum(layer["torch"].values()) == 4 and set(layer["torch"]) <= MATMULS, layer["torch"]
    besides = (two["torch"] - Counter({op: 2 * n for op, n in layer["torch"].items()}),
               two["triton"] - Counter({k: 2 * n for k, n in LAYER_TRITON.items()}))
    assert dict(besides[1]) == {"rmsnorm_kernel": 1}   # the final norm
    assert sum(besides[0].values()) <= 5, besides[0]   # embedding, cos/sin gathered and cast
