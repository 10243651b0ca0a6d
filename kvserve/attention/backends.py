"""Attention backends: read K/V through block tables, write new K/V by slot mapping.

torch: the reference, plain PyTorch (gathers each group's context, then SDPA with a mask).
cpu:   C++ kernels (kvserve/csrc/attention.cpp) reading K/V straight from the blocks: float32 and bfloat16 pools, and
       FP8 pools (kvserve/attention/fp8.py) under float32 or bfloat16 queries.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.attention import fp8, kv_layout
from kvserve.attention.metadata import AttentionMetadata


class TorchPagedAttention:
    """Reference backend in plain PyTorch: gather each group's context through its block tables, then SDPA."""

    name = "torch"

    def cache_shapes(self, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(K shape, V shape) of one layer's pools for this backend (kvserve/attention/kv_layout.py)."""
        return kv_layout.cache_shapes(num_blocks, block_size, num_kv_heads, head_dim, tiled=False)

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata, kv_scales=None) -> None:
        _, hkv, d = kv_layout.geometry(k_cache)
        k, v = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
        if fp8.is_fp8(k_cache.dtype):
            k, v = fp8.quantize(k, k_cache.dtype, kv_scales[0]), fp8.quantize(v, v_cache.dtype, kv_scales[1])
        kv_layout.write_slots(k_cache, v_cache, meta.slot_mapping, k, v)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, num_heads: int, scale: float,
                kv_scales: torch.Tensor | None = None):
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]; the pools may be in either layout, or FP8 (kv_scales)."""
        self.write_kv(k_cache, v_cache, k, v, meta, kv_scales)
        _, hkv, d = kv_layout.geometry(k_cache)
        q = q.view(-1, num_heads, d)
        out = torch.empty_like(q)
        for g in meta.groups:
            qg = q[g.query_idx].transpose(1, 2)          # [G, H, max_q, D]
            kg, vg = kv_layout.read_slots(k_cache, v_cache, g.ctx_slots)
            if fp8.is_fp8(k_cache.dtype):
                kg, vg = fp8.dequantize(kg, kv_scales[0], q.dtype), fp8.dequantize(vg, kv_scales[1], q.dtype)
            kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)   # [G, Hkv, max_ctx, D]
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale,
                                                enable_gqa=hkv != num_heads)
            og = og.transpose(1, 2).reshape(-1, num_heads, d)
            out[g.token_rows] = og[g.valid_idx]
        return out.view(-1, num_heads * d)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CpuPagedAttention(TorchPagedAttention):
    """C++ kernel over the paged cache: no gathered copies of the contexts, no masks, GQA heads share K/V loads."""

    name = "cpu"

    def __init__(self, lib=None):
        self.lib = lib or kernels.load()
        if self.lib is None:
            raise RuntimeError("the C++ CPU kernels are not available")

    def cache_shapes(self, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """bf16 pools on the CPU take the kernel's tiled layout where the build and the geometry allow it."""
        tiled = (torch.device(device).type == "cpu" and bool(self.lib.kvserve_bf16_tiles())
                 and kv_layout.can_tile(dtype, block_size, head_dim, kernels.MAX_HEAD_DIM)
                 and num_heads // num_kv_heads <= kernels.MAX_ROWS)
        return kv_layout.cache_shapes(num_blocks, block_size, num_kv_heads, head_dim, tiled)

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        _, hkv, d = kv_layout.geometry(k_cache)
        return (q.is_cpu and q.dtype in _KERNEL_DTYPES and (k_cache.dtype == q.dtype or fp8.is_fp8(k_cache.dtype))
                and d <= kernels.MAX_HEAD_DIM and q.shape[1:].numel() // d // hkv <= kernels.MAX_ROWS)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, num_heads: int, scale: float,
                kv_scales: torch.Tensor | None = None):
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        if not self.supports(q, k_cache):
            return super().forward(q, k, v, k_cache, v_cache, meta, num_heads, scale, kv_scales)
        if q.dim() != 2 or k.dim() != 2 or v.dim() != 2:
            q, k, v = q.flatten(1), k.flatten(1), v.flatten(1)
        args = meta.kernel_args
        if (k.stride(1) == 1 and v.stride(1) == 1 and k.dtype == v.dtype
                and (k.dtype == k_cache.dtype or fp8.is_fp8(k_cache.dtype) and k.dtype == q.dtype)):
            kernels.write_kv(self.lib, k, v, k_cache, v_cache, args, kv_scales)
        else:
            self.write_kv(k_cache, v_cache, k, v, meta, kv_scales)
        if q.stride(1) != 1:
            q = q.contiguous()
        out = q.new_empty(q.shape[0], q.shape[1])
        kernels.paged_attention(self.lib, q, k_cache, v_cache, out, args, num_heads, scale, kv_scales)
        return out


_BACKENDS = {"torch": TorchPagedAttention, "cpu": CpuPagedAttention}


def get_backend(name: str = "auto"):
    """Return an attention backend instance by name; 'auto' is the C++ CPU backend when it builds, else torch."""
    if name == "auto":
        lib = kernels.load()
        return CpuPagedAttention(lib) if lib is not None else TorchPagedAttention()
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}") from None
