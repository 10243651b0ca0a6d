"""Every Triton kernel variant compiles for sm_80 and sm_90 on this machine, without a GPU (`make gpu-compile`, in its
own process: the tests' interpreter would replace the kernels)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_every_kernel_variant_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "kvserve.attention.triton.compile"], env=env, capture_output=True,
                         text=True, timeout=600)
    print(run.stdout[-4000:], run.stderr[-4000:])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.strip().startswith("sm_")]
    assert any(line.strip().startswith("sm_80") for line in lines) and any("sm_90" in line for line in lines)
    assert all("regs" in line and "FAILED" not in line for line in lines)
