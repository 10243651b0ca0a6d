"""Sampler: processed logits -> one token per row (greedy or random), plus raw logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve import kernels
from kvserve.sample.logits_processors import apply_logits_processors
from kvserve.sample.logprobs import LogprobsTensors, gather_logprobs
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.truncation import apply_min_p, apply_top_k_top_p


@dataclass
class SamplerOutput:
    """The sampled token of each row and, when any row asked, its logprobs."""

    sampled_token_ids: torch.Tensor         # [B] long
    logprobs: LogprobsTensors | None = None


class Sampler(torch.nn.Module):
    """Batched sampler with vLLM V1 semantics; never syncs with the device."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V]; `logits` is left unchanged."""
        if tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match the metadata's "
                             f"({meta.num_rows}, {meta.vocab_size})")
        logits = logits.to(torch.float32)
        # Logprobs are of the raw model distribution, before any penalty, temperature or truncation.
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        sampled = sample(apply_logits_processors(logits, meta), meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs))


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Argmax for greedy rows, the exponential race for random rows."""
    if meta.all_greedy:
        return argmax_rows(logits)
    random = sample_random(logits, meta)
    if meta.all_random:
        return random
    return torch.where(meta.is_greedy, argmax_rows(logits), random)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [B, V] (first maximum; NaN counts as the maximum): the C++ kernel on float32 CPU
    rows, several times faster than torch's over a decode batch's vocabulary (docs/benchmarks.md)."""
    lib = kernels.load() if x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 else None
    if lib is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.kvserve_argmax_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, then one draw per row."""
    logits = logits / meta.temperature.unsqueeze(1)
    # vLLM V1 order: min-p before top-k/top-p (HF and vLLM V0 apply it after, which changes top-p's mass).
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    return argmax_rows(probs.div_(exponential_noise(probs, meta.generators, meta.generator)))


def exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator],
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """q ~ Exponential(1) per token, so argmax(p / q) ~ p. Seeded rows draw from their own generator; the others
    from `generator` (the engine's, seeded by EngineConfig.seed; None: torch's default)."""
    q = torch.empty_like(probs)
    if len(generators) < q.shape[0]:
        q.exponential_(generator=generator)
    # A seeded row draws exactly V values per step from its generator, whatever else is in the batch. The engine
    # makes them on the logits' device; one made elsewhere draws on its own device and is copied, as a generator
    # cannot fill another device's tensor.
    for row, gen in generators.items():
        if gen.device == q.device:
            q[row].exponential_(generator=gen)
        else:
            q[row].copy_(torch.empty(q.shape[1], dtype=q.dtype, device=gen.device).exponential_(generator=gen))
    # q == 0 would make 0/0 = NaN on a masked token, which argmax would pick.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)
