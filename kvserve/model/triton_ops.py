"""Triton kernels for the layer ops between the matmuls on a GPU, in bf16/fp16: RMSNorm with its residual add, RoPE
in place on q|k, SiLU·mul and GELU(tanh)·mul. torch runs each of them as two to eight elementwise kernels; one kernel
each keeps a decode step's graph short. They round where the torch ops (kvserve/model/layers.py, the definition) round:
products and sums in float32, one rounding to the dtype wherever torch stores an intermediate (the GPU compiler may
still pick native bf16/fp16 instructions for those steps: tests/test_triton_layer_ops.py holds RoPE bit for bit in
the interpreter, and all three within two steps of the dtype on a GPU). float32 models keep the torch ops (the
reference path tests compare with transformers).

The layer modules call them through layers.py (`_gpu_ops`) on CUDA tensors; the launchers make no torch.cuda calls,
so the tests run them on CPU tensors under TRITON_INTERPRET=1 too."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride, n, eps,
                   HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row: s = x + residual (rounded, also stored as the new residual), out = w * (s * rsqrt(mean(s^2) + eps))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * n + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, x_stride, HEAD_DIM: tl.constexpr):
    """Head program_id(1) of row program_id(0), in place: x * cos + rotate_half(x) * sin, each product rounded."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = tl.arange(0, HEAD_DIM // 2)
    base = x_ptr + row * x_stride + head * HEAD_DIM
    x1 = tl.load(base + half).to(tl.float32)
    x2 = tl.load(base + HEAD_DIM // 2 + half).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + row * HEAD_DIM + half).to(tl.float32)
    c2 = tl.load(cos_ptr + row * HEAD_DIM + HEAD_DIM // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + row * HEAD_DIM + half).to(tl.float32)
    s2 = tl.load(sin_ptr + row * HEAD_DIM + HEAD_DIM // 2 + half).to(tl.float32)
    out1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    out2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(base + half, out1.to(dt))
    tl.store(base + HEAD_DIM // 2 + half, out2.to(dt))


@triton.jit
def _gate_up(x_ptr, x_stride, n, BLOCK: tl.constexpr):
    """A gated activation's program: (row, its columns, their mask, gate and up in float32) of a [T, 2n] gate|up."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + offs, mask=mask, other=0.0).to(tl.float32)
    return row, offs, mask, gate, up


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, x_stride, n, BLOCK: tl.constexpr):
    """out[row, j] = silu(x[row, j]) * x[row, n + j] (silu rounded first, as torch's two ops)."""
    row, offs, mask, gate, up = _gate_up(x_ptr, x_stride, n, BLOCK)
    dt = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (silu * up).to(dt), mask=mask)


@triton.jit
def gelu_tanh_mul_kernel(x_ptr, out_ptr, x_stride, n, BLOCK: tl.constexpr):
    """out[row, j] = gelu_tanh(x[row, j]) * x[row, n + j] (GeGLU: Gemma; the gelu rounded first, as torch's two
    ops): gelu_tanh(g) = g / 2 (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^-2z) (the
    same function: 1 + tanh(z) = 2 / (1 + e^-2z)), which keeps its precision where tanh(z) nears -1."""
    row, offs, mask, gate, up = _gate_up(x_ptr, x_stride, n, BLOCK)
    dt = out_ptr.dtype.element_ty
    z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    gelu = (gate / (1.0 + tl.exp(-2.0 * z))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (gelu * up).to(dt), mask=mask)


# each kernel's (constexprs, launch options) for a width: the launchers' and kvserve/attention/triton/compile.py's
def rmsnorm_meta(n: int, has_residual: bool) -> tuple[dict, dict]:
    return dict(HAS_RESIDUAL=has_residual, BLOCK=triton.next_power_of_2(n)), dict(num_warps=4 if n <= 4096 else 8)


def rope_meta(head_dim: int) -> tuple[dict, dict]:
    # no fused multiply-adds: each product is rounded before the sum, as in apply_rotary
    return dict(HEAD_DIM=head_dim), dict(num_warps=1, enable_fp_fusion=False)


def silu_mul_meta(n: int) -> tuple[dict, dict]:
    return dict(BLOCK=min(1024, triton.next_power_of_2(n))), {}


gelu_tanh_mul_meta = silu_mul_meta


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm.forward's result for 2-d x with contiguous rows: out, or (out, x + residual)."""
    n = x.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if x.shape[0]:
        constexprs, options = rmsnorm_meta(n, residual is not None)
        rmsnorm_kernel[(x.shape[0],)](x, residual if residual is not None else x, weight, out, new_residual,
                                      x.stride(0), residual.stride(0) if residual is not None else 0, n, eps,
                                      **constexprs, **options)
    return out if residual is None else (out, new_residual)


def rope_inplace(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first num_heads heads of every row of x [T, >= num_heads * head_dim] in place; cos/sin
    [T, 1, head_dim] contiguous in x's dtype."""
    if x.shape[0]:
        constexprs, options = rope_meta(head_dim)
        rope_kernel[(x.shape[0], num_heads)](x, cos, sin, x.stride(0), **constexprs, **options)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [T, 2I] gate|up tensor with contiguous rows."""
    return _gated(silu_mul_kernel, silu_mul_meta, x)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up of a [T, 2I] gate|up tensor with contiguous rows."""
    return _gated(gelu_tanh_mul_kernel, gelu_tanh_mul_meta, x)


def _gated(kernel, meta, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    constexprs, options = meta(n)
    if x.shape[0]:
        kernel[(x.shape[0], triton.cdiv(n, constexprs["BLOCK"]))](x, out, x.stride(0), n, **constexprs, **options)
    return out
