"""What a decode step's forward launches on a GPU, counted on the CPU (tests/gpu_step_ops.py: the GPU's ops on CPU
tensors, Triton under its interpreter). A captured decode graph replays one kernel per launch, and on small models
their number, not the bytes they read, sets the step's time: each layer is 4 matmuls (q|k|v, o, gate|up, down) and 6
Triton kernels (RMSNorm with its residual add twice, RoPE on q|k in place, the KV write, the attention, SiLU·mul;
a decode whose keys split over the GPU adds the merge kernel, which these short contexts do not take),
and the rest of the forward the embedding, the RoPE tables' gather and the final norm; Gemma 3's layers have more
norms and GeGLU for SiLU·mul, all in Triton too. An op more per layer (a copy, a cast, an op the Triton kernels should
have taken) fails here."""
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
ATTENTION = {"rope_kernel": 1, "write_kv_kernel": 1, "unified_attention_kernel": 1}
LAYER_TRITON = {  # each family's Triton launches a layer
    "llama": {"rmsnorm_kernel": 2, "silu_mul_kernel": 1, **ATTENTION},
    # four norms around attention and MLP, q and k normed (and so rotated) apart, GeGLU
    "gemma3": {"rmsnorm_kernel": 6, "gelu_tanh_mul_kernel": 1, **ATTENTION, "rope_kernel": 2}}
MATMULS = {"mm.default", "addmm.default", "_linear_pointwise.default", "linear.default"}   # CUDA's, the CPU's


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    env = {**os.environ, "KVSERVE_KERNELS": "none", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path_factory.mktemp("ops"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", LAYER_TRITON)
def test_a_decode_forward_launches_its_layers_kernels_and_six_besides(counts, family):
    two, three = ({kind: Counter(counts[family][n][kind]) for kind in ("torch", "triton")} for n in ("2", "3"))
    layer = {kind: three[kind] - two[kind] for kind in ("torch", "triton")}
    assert dict(layer["triton"]) == LAYER_TRITON[family]
    assert sum(layer["torch"].values()) == 4 and set(layer["torch"]) <= MATMULS, layer["torch"]
    besides = (two["torch"] - Counter({op: 2 * n for op, n in layer["torch"].items()}),
               two["triton"] - Counter({k: 2 * n for k, n in LAYER_TRITON[family].items()}))
    assert dict(besides[1]) == {"rmsnorm_kernel": 1}   # the final norm
    # the embedding, each RoPE table's cos/sin gathered and cast (Gemma 3: two tables, and its embedding's scale)
    assert sum(besides[0].values()) <= (5 if family == "llama" else 11), besides[0]
