"""Attention backends: read K/V through block tables, write new K/V by slot mapping.

torch: the reference, plain PyTorch (gathers each group's context, then SDPA with a mask).
cpu:   C++ kernels (kvserve/attention/cpu_kernels.py) reading K/V straight from the blocks, float32 and bfloat16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention import cpu_kernels
from kvserve.attention.metadata import AttentionMetadata


class TorchPagedAttention:
    """Reference backend in plain PyTorch: gather each group's context through its block tables, then SDPA."""

    name = "torch"

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        hkv, d = k_cache.shape[-2:]
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.view(-1, hkv, d).to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.view(-1, hkv, d).to(v_cache.dtype))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, num_heads: int, scale: float):
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        self.write_kv(k_cache, v_cache, k, v, meta)
        hkv, d = k_cache.shape[-2:]
        q = q.view(-1, num_heads, d)
        k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        out = torch.empty_like(q)
        for g in meta.groups:
            qg = q[g.query_idx].transpose(1, 2)          # [G, H, max_q, D]
            kg = k_flat[g.ctx_slots].transpose(1, 2)     # [G, Hkv, max_ctx, D]
            vg = v_flat[g.ctx_slots].transpose(1, 2)
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
        self.lib = lib or cpu_kernels.load()
        if self.lib is None:
            raise RuntimeError("the C++ CPU kernels are not available")

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (q.is_cpu and q.dtype in _KERNEL_DTYPES and k_cache.dtype == q.dtype
                and k_cache.shape[-1] <= cpu_kernels.MAX_HEAD_DIM)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, num_heads: int, scale: float):
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        if not self.supports(q, k_cache):
            return super().forward(q, k, v, k_cache, v_cache, meta, num_heads, scale)
        if q.dim() != 2 or k.dim() != 2 or v.dim() != 2:
            q, k, v = q.flatten(1), k.flatten(1), v.flatten(1)
        args = meta.kernel_args
        if k.stride(1) == 1 and v.stride(1) == 1 and k.dtype == v.dtype == k_cache.dtype:
            cpu_kernels.write_kv(self.lib, k, v, k_cache, v_cache, args)
        else:
            self.write_kv(k_cache, v_cache, k, v, meta)
        if q.stride(1) != 1:
            q = q.contiguous()
        out = q.new_empty(q.shape[0], q.shape[1])
        cpu_kernels.paged_attention(self.lib, q, k_cache, v_cache, out, args, num_heads, scale)
        return out


_BACKENDS = {"torch": TorchPagedAttention, "cpu": CpuPagedAttention}


def get_backend(name: str = "auto"):
    """Return an attention backend instance by name; 'auto' is the C++ CPU backend when it builds, else torch."""
    if name == "auto":
        lib = cpu_kernels.load()
        return CpuPagedAttention(lib) if lib is not None else TorchPagedAttention()
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}") from None
