"""Rotary position embedding: the inverse frequencies of each rope scaling type, and the cos/sin tables every layer
reads (the rotation itself is layers.apply_rotary, and its one-kernel paths layers.rotate_heads_inplace)."""
from __future__ import annotations

import math

import torch

from kvserve.errors import ModelLoadError
from kvserve.module import InferenceModule


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, a smooth ramp between."""
    try:
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ModelLoadError(f"llama3 rope scaling needs {e.args[0]!r}") from None
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], position scale) for the configured rope type."""
    inv_freq = _default_inv_freq(head_dim, base)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq, 1.0 / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "gguf_freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32), 1.0
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported")


# cos/sin tables for every position up to the context cost 2 x max_position x head_dim floats per RoPE kind (Gemma
# 3's two at 32k tokens: 128 MB); above this size they are computed for each step's positions instead (the same
# values: the same float32 products and cos/sin), which costs a few more small ops per step
MAX_TABLE_BYTES = 32 << 20


class RotaryEmbedding(InferenceModule):
    """Rotary position embedding (HF rotate_half layout): cos/sin of each step's positions, from tables of every
    position where they are small (MAX_TABLE_BYTES), else computed for them (no host sync either way)."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq, self.pos_scale = rope_inv_freq(head_dim, base, scaling)
        # buffers are not persistent: rebuilt from the config, never read from a checkpoint
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        small = 2 * max_position * head_dim * 4 <= MAX_TABLE_BYTES
        cos, sin = self._angles(torch.arange(max_position)) if small else (None, None)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (positions.to(torch.float32) * self.pos_scale)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for `positions`, ready to broadcast over heads."""
        if self.cos_cache is not None:
            cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        else:
            cos, sin = self._angles(positions)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
