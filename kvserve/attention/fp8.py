"""FP8 KV cache: one byte per K/V value, twice the tokens of a bf16 pool (four times float32's) in the same memory.

`kv_cache_dtype` (`--kv-cache-dtype`): "auto" keeps the model's dtype; "fp8" and "fp8_e4m3" store e4m3 (3 mantissa
bits, largest 448), "fp8_e5m2" stores e5m2 (2 mantissa bits, largest 57344: range over precision).
Each attention layer has two scales, K's and V's (`Attention.kv_scales`, float32 [2]): a pool holds
fp8(x / scale), saturated to the largest finite value and rounded to nearest even; attention multiplies the
scale back in (K's folded into the queries, V's into the output). They are 1.0 unless `calculate_kv_scales`
(`--calculate-kv-scales`) sets them from the first step's K and V: scale = max |x| / (largest / 2), room for later
values up to twice the first step's largest while small values stay out of the subnormals (more room measured
worse, docs/quantization.md). The first step should be representative: a long prompt, not a greeting.
"""
from __future__ import annotations

import torch

_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# the C++ kernels' format codes (kvserve/csrc/common.h Fp8Format)
FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
CALIBRATION_HEADROOM = 2.0


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' dtype for a kv_cache_dtype name (validated by EngineConfig)."""
    return model_dtype if kv_cache_dtype == "auto" else _DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether pools of this dtype hold FP8 values."""
    return dtype in FORMATS


def largest(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3, 57344 for e5m2)."""
    return torch.finfo(dtype).max


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """fp8(x / scale) as the pools store it (the C++ write multiplies by the same float32 reciprocal)."""
    m = largest(dtype)
    return (x.float() * scale.reciprocal()).clamp_(-m, m).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool values back to `dtype` (float32 products, then rounded once)."""
    return (x.float() * scale).to(dtype)


def calibrated_scales(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[K's scale, V's scale] from one step's K and V (see the module docstring)."""
    amax = torch.stack([k.detach().abs().amax().float(), v.detach().abs().amax().float()])
    target = largest(dtype) / CALIBRATION_HEADROOM
    return torch.where(amax > 0, amax / target, torch.ones_like(amax))
