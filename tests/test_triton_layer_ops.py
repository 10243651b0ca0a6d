"""The Triton layer ops (kvserve/model/triton_ops.py: RMSNorm with its residual add, RoPE in place, SiLU·mul and
GELU(tanh)·mul) equal
the torch ops of kvserve/model/layers.py: RoPE bit for bit (the same roundings), the norm and SiLU·mul to one rounding
of the dtype. On a CUDA machine in bf16 and fp16 natively; elsewhere in fp16 under Triton's interpreter (conftest.py),
where a model's forward with them is compared with its forward on the torch ops too."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.attention.triton import unavailable_reason  # noqa: E402
from kvserve.model import layers, rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(unavailable_reason(DEVICE) is not None,
                                reason=f"Triton cannot run here: {unavailable_reason(DEVICE)}")
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable steps of the dtype lie between a and b, elementwise."""
    eps = torch.finfo(a.dtype).eps
    return ((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1e-3) * eps)).ceil()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_with_and_without_residual(dtype):
    from kvserve.model import triton_ops
    g = torch.Generator().manual_seed(0)
    norm = layers.RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    r = torch.randn(37, 576, generator=g).to(dtype)
    norm, x, r = norm.to(DEVICE), x.to(DEVICE), r.to(DEVICE)
    want_out = x + r
    xf = want_out.float()
    want_out = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out, res = triton_ops.rmsnorm(x, norm.weight, 1e-5, r)
    assert torch.equal(res, x + r)   # the residual sum is one rounding of an exact float32 sum: bit for bit
    assert ulps_apart(out, want_out).max() <= 2
    alone = triton_ops.rmsnorm(x, norm.weight, 1e-5)
    xf = x.float()
    assert ulps_apart(alone, norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
                      ).max() <= 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_in_place_equals_apply_rotary(dtype, head_dim):
    """Bit for bit in the interpreter (the same roundings, in numpy); on a GPU within 2 steps of the dtype (an H200
    run differed from the CPU's apply_rotary in some bits before fused multiply-adds were turned off)."""
    from kvserve.model import triton_ops
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, t = 6, 2, 19
    rope = rotary.RotaryEmbedding(head_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (t,), generator=g)
    cos, sin = rope(positions, dtype)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    want = qkv.clone()
    q = want[:, :(heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    want[:, :(heads + kv_heads) * head_dim] = layers.apply_rotary(q, cos, sin).flatten(1)
    got = qkv.to(DEVICE)
    triton_ops.rope_inplace(got, heads + kv_heads, head_dim, cos.to(DEVICE), sin.to(DEVICE))
    got = got.cpu()
    assert torch.equal(got[:, (heads + kv_heads) * head_dim:], want[:, (heads + kv_heads) * head_dim:])   # v
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        assert ulps_apart(got, want).max() <= 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul(dtype):
    from kvserve.model import triton_ops
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(23, 2 * 1536, generator=g) * 4).to(dtype).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    assert ulps_apart(triton_ops.silu_mul(x), torch.nn.functional.silu(gate) * up).max() <= 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_mul(dtype):
    """GeGLU (Gemma): the tanh-approximated GELU, rounded, times up, against the function in float64 (rounded the
    same way) and torch's two ops; large gates too, where tanh saturates (exp overflows there: 0, as it should)."""
    from kvserve.model import triton_ops
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(23, 2 * 1152, generator=g) * 4).to(dtype)
    x[:, :8] = torch.tensor([-100.0, -30.0, -9.0, -0.01, 0.0, 1e-4, 0.5, 30.0], dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    gd = gate.double()
    exact = (gd / 2 * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gd + 0.044715 * gd ** 3)))).to(dtype) * up
    with np_errors_ignored():
        got = triton_ops.gelu_tanh_mul(x.to(DEVICE)).cpu()
    assert ulps_apart(got, exact).max() <= 1
    assert ulps_apart(got, torch.nn.functional.gelu(gate, approximate="tanh") * up).max() <= 2
    assert torch.equal(got[:, :2], torch.zeros(23, 2, dtype=dtype))   # far left of 0: gelu is 0 (e^-2z = inf)


def np_errors_ignored():
    """The interpreter runs the kernels in numpy, which warns where exp overflows (to inf, as on a GPU)."""
    import numpy as np
    return np.errstate(over="ignore")


@pytest.mark.parametrize("family,ops", [("llama", {"rmsnorm", "rope_inplace", "silu_mul"}),
                                        ("gemma3", {"rmsnorm", "rope_inplace", "gelu_tanh_mul"})])
def test_a_model_forward_with_the_triton_ops_equals_the_torch_ops(tmp_path, monkeypatch, family, ops):
    """A tiny Llama's and Gemma 3's whole forward (attention on the Triton backend either way) with the layer ops in
    Triton against the torch ops: the hidden states agree to the dtype's rounding. On CUDA in bf16 through the layers'
    own dispatch (layers._gpu_ops); on the CPU in fp16, the dispatch pointed at the Triton ops (it sends only CUDA
    tensors)."""
    from kvserve.attention import bind_kv_cache, single_sequence_metadata
    from kvserve.attention.backends import TritonPagedAttention
    from kvserve.config import EngineConfig
    from kvserve.model import load_model, triton_ops
    from model_utils import GEMMA3, save_tiny_model
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    save_tiny_model(family, tmp_path / "m", vocab_size=96, **(GEMMA3 if family == "gemma3" else {}))
    model, _ = load_model(EngineConfig(model=str(tmp_path / "m"), dtype=str(dtype).removeprefix("torch."),
                                       device=DEVICE))
    bind_kv_cache(model, 8, 16, dtype, DEVICE, TritonPagedAttention(DEVICE))
    ids = torch.randint(3, 96, (40,)).to(DEVICE)
    meta = single_sequence_metadata(40, 16, DEVICE)
    calls = []
    for name in ops:
        def counted(*args, _fn=getattr(triton_ops, name), _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(triton_ops, name, counted)
    with torch.inference_mode():
        if DEVICE == "cpu":
            monkeypatch.setattr(layers, "_gpu_ops", lambda x: triton_ops if x.dim() == 2 and x.stride(1) == 1
                                else None)
        fused = model(ids, torch.arange(40, device=DEVICE), meta)
        assert ops <= set(calls)
        monkeypatch.setattr(layers, "_gpu_ops", lambda x: None)
        plain = model(ids, torch.arange(40, device=DEVICE), meta)
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    torch.testing.assert_close(fused.float(), plain.float(), atol=tol, rtol=tol)
