"""The Attention module every model layer calls; it owns a view of its layer's KV cache."""
from __future__ import annotations

import math
import mmap
import warnings

import torch
from torch import nn

from kvserve.attention import fp8
from kvserve.attention.backends import get_backend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.module import InferenceModule


class Attention(InferenceModule):
    """Paged multi-head / grouped-query attention over the layer's KV cache blocks."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window   # a token sees only the last sliding_window keys up to its own
        self.softcap = softcap   # scaled scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2)
        # bound by bind_kv_cache(), in the backend's layout (kvserve/attention/kv_layout.py)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # FP8 pools: [K's scale, V's scale] (kvserve/attention/fp8.py); set from the next step's K/V when
        # calibrate_kv_scales (bind_kv_cache's calculate_kv_scales)
        self.kv_scales = torch.ones(2, dtype=torch.float32)   # the kernels read float32
        self.calibrate_kv_scales = False
        self.backend = None   # bind_kv_cache sets it: the engine's attention_backend, or the device's default
        self.kv_group = 0     # which KV group's block tables it reads (kvserve/core/kv_groups.py; bind_kv_cache)

    def forward(self, q, k, v, attn_metadata: AttentionMetadata):
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        if self.calibrate_kv_scales:
            self.kv_scales.copy_(fp8.calibrated_scales(k, v, self.k_cache.dtype))
            self.calibrate_kv_scales = False
        if self.kv_group:
            attn_metadata = attn_metadata.kv_groups[self.kv_group - 1]
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, attn_metadata,
                                    self.num_heads, self.scale, self.kv_scales, self.sliding_window, self.softcap)


_default_backends = {}


def default_backend(device: torch.device | str = "cpu"):
    """The backend of pools bound without one: get_backend("auto") for the device type, made once per type."""
    kind = torch.device(device).type
    if kind not in _default_backends:
        _default_backends[kind] = get_backend("auto", kind)
    return _default_backends[kind]


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's Attention modules in layer order."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype, groups=None) -> int:
    """Bytes one KV block takes across all layers (K and V); with KV groups (kvserve/core/kv_groups.py), across
    the layers of one group: a block id is a page of each of its pools."""
    elem = torch.tensor([], dtype=dtype).element_size()
    layers = attention_layers(model)
    if groups is not None:
        layers = [a for a, g in zip(layers, groups.layer_group) if g == 0]
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * elem for a in layers)


def window_groups(model: nn.Module):
    """The KV groups of a model whose layers have sliding windows (KVGroups.from_windows), or None: no window, or
    layers of different K/V shapes (they could not share pools)."""
    from kvserve.core.kv_groups import KVGroups
    layers = attention_layers(model)
    if not any(a.sliding_window for a in layers) or len({(a.num_kv_heads, a.head_dim) for a in layers}) != 1:
        return None
    return KVGroups.from_windows([a.sliding_window for a in layers])


def bind_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu", backend=None,
                  calculate_kv_scales: bool = False, groups=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate one K and one V pool per layer and bind them to the model's Attention modules. dtype: the pools'
    (an FP8 dtype stores scaled values: kvserve/attention/fp8.py; calculate_kv_scales sets each layer's scales
    from the next step, else they are 1.0). groups (KVGroups): one pool pair per place in a group, shared by the
    layers at that place in every group, each layer reading its group's block tables."""
    caches = []
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(attention_layers(model)):
        layer.kv_group = groups.layer_group[i] if groups is not None else 0
        if backend is not None:
            layer.backend = backend
        elif layer.backend is None:
            layer.backend = default_backend(device)
        layer.kv_scales = torch.ones(2, dtype=torch.float32, device=device)
        layer.calibrate_kv_scales = calculate_kv_scales and fp8.is_fp8(dtype)
        k_shape, v_shape = layer.backend.cache_shapes(num_blocks, block_size, layer.num_heads, layer.num_kv_heads,
                                                      layer.head_dim, dtype, device)
        slot = groups.layer_slot[i] if groups is not None else i
        if slot not in shared:
            shared[slot] = zeros_on_demand(k_shape, dtype, device), zeros_on_demand(v_shape, dtype, device)
        layer.k_cache, layer.v_cache = shared[slot]
        caches.append((layer.k_cache, layer.v_cache))
    return caches


def zeros_on_demand(shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor whose CPU memory the OS supplies page by page as it is first written (an anonymous mapping,
    page-aligned): a KV pool costs resident memory only for the blocks requests have used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # anonymous and private (as malloc's own large blocks): zero-filled, writable, freed with the last tensor viewing it
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    with warnings.catch_warnings():   # "not writable" is about buffers torch cannot tell: this one is
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
