"""Attention backends: read K/V through block tables, write new K/V by slot mapping.

torch: the reference, plain PyTorch (gathers each group's context, then SDPA with a mask).
cpu:   C++ kernels (kvserve/csrc/attention*.cpp) reading K/V straight from the blocks: float32 and bfloat16 pools, and
       FP8 pools (kvserve/attention/fp8.py) under float32 or bfloat16 queries.
triton: Triton kernels (kvserve/attention/triton/): one launch per layer for the whole mixed step, on CUDA tensors (or
       CPU tensors under TRITON_INTERPRET=1): float32, bfloat16 and float16 pools, FP8 pools, sliding windows.

`attention_backend` (EngineConfig, --attention-backend) names one; "auto" takes triton on CUDA and the C++ kernels
on the CPU (torch where they do not build, with a warning).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.attention import fp8, kv_layout
from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import ATTENTION_BACKENDS
from kvserve.errors import InvalidRequestError

logger = logging.getLogger("kvserve")


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
                kv_scales: torch.Tensor | None = None, sliding_window: int | None = None,
                softcap: float | None = None):
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]; the pools may be in either layout, or FP8 (kv_scales); a
        sliding window W lets a token see only the last W keys up to its own; softcap c turns each scaled score s
        into c * tanh(s / c) before the softmax."""
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
            mask = g.mask
            if sliding_window:
                ctx = torch.arange(mask.shape[-1], device=mask.device)
                mask = mask & (g.query_pos[:, None, :, None] - ctx < sliding_window)
            if softcap:
                og = _softcapped_attention(qg, kg, vg, mask, scale, softcap)
            else:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale,
                                                    enable_gqa=hkv != num_heads)
            og = og.transpose(1, 2).reshape(-1, num_heads, d)
            out[g.token_rows] = og[g.valid_idx]
        return out.view(-1, num_heads * d)


def _softcapped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """softmax(cap * tanh(scale * q k^T / cap)) v, masked; q [G, H, Q, D], k/v [G, Hkv, C, D] (GQA repeats)."""
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / cap) * cap
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)   # a row with no key: zeros
    return torch.matmul(p, v.float()).to(q.dtype)


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
                kv_scales: torch.Tensor | None = None, sliding_window: int | None = None,
                softcap: float | None = None):
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        if not self.supports(q, k_cache):
            return super().forward(q, k, v, k_cache, v_cache, meta, num_heads, scale, kv_scales, sliding_window,
                                   softcap)
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
        kernels.paged_attention(self.lib, q, k_cache, v_cache, out, args, num_heads, scale, kv_scales, sliding_window,
                                softcap)
        return out


class TritonPagedAttention(TorchPagedAttention):
    """Triton kernels (kvserve/attention/triton/) over the standard layout: a KV write by slot mapping, then one
    unified attention launch for every sequence of the step. Typed ops: torch.compile and CUDA graphs see them."""

    name = "triton"
    MIN_BLOCK_SIZE = 16
    MAX_HEAD_DIM = 256

    def __init__(self, device: torch.device | str = "cuda"):
        from kvserve.attention.triton import unavailable_reason
        reason = unavailable_reason(device)
        if reason is not None:
            raise InvalidRequestError(f"attention_backend triton cannot run: {reason}", "attention_backend")
        from kvserve.attention.triton import ops
        self.ops = ops

    def cache_shapes(self, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if block_size < self.MIN_BLOCK_SIZE or block_size & (block_size - 1):
            raise InvalidRequestError(f"attention_backend triton takes a block_size that is a power of two of at "
                                      f"least {self.MIN_BLOCK_SIZE}, got {block_size}", "block_size")
        if head_dim > self.MAX_HEAD_DIM:
            raise InvalidRequestError(f"attention_backend triton takes head dims up to {self.MAX_HEAD_DIM}, the model "
                                      f"has {head_dim}", "attention_backend")
        if (fp8.is_fp8(dtype) and torch.device(device).type == "cuda"
                and torch.cuda.get_device_capability(device) < (8, 9)):
            raise InvalidRequestError("attention_backend triton stores FP8 KV on GPUs of compute capability 8.9 or "
                                      "newer (Ada, Hopper); use kv_cache_dtype auto here", "kv_cache_dtype")
        return kv_layout.cache_shapes(num_blocks, block_size, num_kv_heads, head_dim, tiled=False)

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata, kv_scales=None) -> None:
        row = k_cache.shape[2] * k_cache.shape[3]
        k, v = k.reshape(-1, row), v.reshape(-1, row)
        if k.stride(1) != 1 or v.stride(1) != 1:
            k, v = k.contiguous(), v.contiguous()
        write = self.ops.write_kv if torch.compiler.is_compiling() else self.ops.launch_write_kv
        write(k, v, k_cache, v_cache, meta.slot_mapping, _scales(kv_scales, k))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, num_heads: int, scale: float,
                kv_scales: torch.Tensor | None = None, sliding_window: int | None = None,
                softcap: float | None = None):
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        self.write_kv(k_cache, v_cache, k, v, meta, kv_scales)
        q = q.reshape(q.shape[0], -1)
        if q.stride(1) != 1:
            q = q.contiguous()
        attend = self.ops.unified_attention if torch.compiler.is_compiling() else self.ops.launch_unified_attention
        return attend(q, k_cache, v_cache, meta.block_table_tensor, meta.seq_lens_tensor, meta.query_start_loc,
                      _scales(kv_scales, q), num_heads, scale, int(sliding_window or 0), float(softcap or 0.0))


def _scales(kv_scales: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return kv_scales if kv_scales is not None else torch.ones(2, dtype=torch.float32, device=like.device)


def get_backend(name: str = "auto", device: torch.device | str = "cpu"):
    """An attention backend instance by name (ATTENTION_BACKENDS) for `device`. auto: triton on CUDA, the C++ kernels
    on the CPU when they build, else torch with a warning."""
    kind = torch.device(device).type
    if name == "auto":
        if kind == "cuda":
            from kvserve.attention.triton import unavailable_reason
            reason = unavailable_reason(device)
            if reason is None:
                return TritonPagedAttention(device)
            logger.warning("kvserve: attention in plain torch (the reference backend): %s", reason)
            return TorchPagedAttention()
        lib = kernels.load() if kind == "cpu" else None
        return CpuPagedAttention(lib) if lib is not None else TorchPagedAttention()
    if name == "torch":
        return TorchPagedAttention()
    if name == "cpu":
        if kind != "cpu":
            raise InvalidRequestError(f"attention_backend cpu runs the C++ kernels on the CPU, not on {kind}",
                                      "attention_backend")
        lib = kernels.load()
        if lib is None:
            raise InvalidRequestError(f"attention_backend cpu: the C++ kernels did not build ({kernels.status().reason})",
                                      "attention_backend")
        return CpuPagedAttention(lib)
    if name == "triton":
        return TritonPagedAttention(device)
    raise InvalidRequestError(f"unknown attention backend {name!r}; choose from {', '.join(ATTENTION_BACKENDS)}",
                              "attention_backend")
