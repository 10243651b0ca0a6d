"""Attention backends: read K/V through block tables, write new K/V by slot mapping."""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


_BACKENDS = {"torch": TorchPagedAttention}


def get_backend(name: str = "torch"):
    """Return an attention backend instance by name."""
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}") from None
