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
    """Argmax for greedy rows, a draw by inverse CDF for random rows."""
    if meta.all_greedy:
        return argmax_rows(logits)
    random = sample_random(logits, meta)
    if meta.all_random:
        return random
    return torch.where(meta.is_greedy, argmax_rows(logits), random)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [B, V] (first maximum; NaN counts as the maximum): the C++ kernel on float32 CPU
    rows, several times faster than torch's over a decode batch's vocabulary (benchmarks/LOG.md)."""
    lib = kernels.load() if x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 else None
    if lib is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.kvserve_argmax_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One draw per row from its distribution (random_probs); rows verifying drawn drafts by rejection sampling."""
    probs = random_probs(logits, meta)
    u = uniform_noise(probs.shape[0], probs.device, meta.generators, meta.generator)
    if meta.sampled_drafts is not None:
        return verify_sampled_drafts(probs, u, meta)
    return inverse_cdf(probs, u)


def random_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Each row's distribution after temperature, min-p, top-k and top-p."""
    logits = logits / meta.temperature.unsqueeze(1)
    # vLLM V1 order: min-p before top-k/top-p (HF and vLLM V0 apply it after, which changes top-p's mass).
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits.softmax(dim=-1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` [B, V] (>= 0), the first token whose cumulative weight exceeds u times the row's total:
    for u ~ U[0, 1), a draw from weights / total. One pass over the row and one random number, where a race of V
    exponentials needs V of them; the sums are float64, so a token's share is exact to ~1e-16 of the row's."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # u * total can round up to the total itself (u = 1 - 2^-53): keep the target below it
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    # right: a token of weight 0 spans no interval and is never drawn; the clamp keeps a NaN row in range
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(weights.shape[1] - 1)


def verify_sampled_drafts(probs: torch.Tensor, u: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Rejection sampling (Leviathan et al.) where drafts were drawn from q: a verifying row keeps its draft d with
    probability min(1, p(d) / q(d)), else it takes a token from norm(max(0, p - q)), the distribution that makes
    the row's token follow p either way; every other row draws from p. The residual's draw uses the row's u,
    which its draw from p would have used: only one of the two is kept. The acceptance tests draw from
    meta.generator: drafts are drawn for requests without a seed only (kvserve.spec_decode.draft_sampling)."""
    d = meta.sampled_drafts
    p = probs[d.rows]
    p_draft = p.gather(1, d.token_ids.unsqueeze(1)).squeeze(1)
    q_draft = d.probs.gather(1, d.token_ids.unsqueeze(1)).squeeze(1)
    keep = uniform_noise(d.rows.shape[0], p.device, {}, meta.generator).mul_(q_draft) < p_draft
    residual = p.sub_(d.probs).clamp_min_(0)
    tokens = inverse_cdf(probs, u)
    recovered = inverse_cdf(residual, u[d.rows])
    # p = q up to rounding leaves no residual mass: such a row keeps its draft but with probability ~1e-7
    recovered = torch.where(residual.amax(dim=-1) > 0, recovered, tokens[d.rows])
    tokens[d.rows] = torch.where(keep, d.token_ids, recovered)
    return tokens


def uniform_noise(num_rows: int, device: torch.device | str, generators: dict[int, torch.Generator],
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """u ~ U[0, 1) (float64) per row. A seeded row draws from its own generator (draw_uniform), one value per
    step whatever else is in the batch; the others from `generator` (the engine's, seeded by EngineConfig.seed;
    None: torch's default)."""
    u = torch.empty(num_rows, dtype=torch.float64, device=device)
    if len(generators) < num_rows:
        u.uniform_(generator=generator)
    for row, gen in generators.items():
        # a generator made on another device than the logits' draws there: it cannot fill another device's tensor
        u[row] = draw_uniform(gen).to(u.device)
    return u


def draw_uniform(generator: torch.Generator) -> torch.Tensor:
    """One seeded row's draw for a step (model_runner._rewind replays them)."""
    return torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
