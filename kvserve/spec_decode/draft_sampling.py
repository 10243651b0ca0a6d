"""Drafts drawn from the draft model's distribution q, and the rows that verify them against the target's p.

A random request's draft is a draw from the draft's distribution under the request's own sampling settings
(penalties, logit bias, temperature, min-p, top-k, top-p), kept with q; the target keeps it with probability
min(1, p/q) (kvserve.sample.sampler.verify_sampled_drafts). That accepts sum_x min(p(x), q(x)) of the drafts,
where the draft's argmax is accepted with p(argmax q): often more where p spreads over several tokens and q
resembles p (an underconfident q can do worse). Greedy requests take the argmax (q one-hot), and
so do seeded ones: their drafts stay deterministic, so their output is the one they give without speculation
whatever the batch (model_runner._sample rewinds their generators to the draws actually used).
"""
from __future__ import annotations

import math

import torch

from kvserve.core.request import Request
from kvserve.sample.logits_processors import apply_logits_processors
from kvserve.sample.metadata import SampledDrafts, SamplingMetadata
from kvserve.sample.sampler import argmax_rows, inverse_cdf, random_probs, uniform_noise


def draws_drafts(req: Request) -> bool:
    """Whether `req`'s drafts are drawn from q rather than taken as the draft's argmax."""
    return not req.params.is_greedy and req.generator is None


def next_drafts(logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]], vocab_size: int,
                generator: torch.Generator | None) -> list[tuple[int, torch.Tensor | None]]:
    """Each request's next draft from the draft model's logits [len(reqs), N <= vocab_size] (its drafts so far
    count as output): (token, None) for an argmax, (token, q [vocab_size]) for a draw from q."""
    tokens = argmax_rows(logits)
    drawn = [j for j, req in enumerate(reqs) if draws_drafts(req)]
    q = None
    if drawn:
        # a draft with a cut vocabulary (draft_vocab_size) proposes none of the tokens past its N
        full = logits.new_full((len(drawn), vocab_size), -math.inf, dtype=torch.float32)
        full[:, :logits.shape[1]] = logits[drawn]
        rows = [reqs[j].sampling_row(drafts[j], None) for j in drawn]
        meta = SamplingMetadata.build(rows, vocab_size, logits.device, generator)
        q = random_probs(apply_logits_processors(full, meta), meta)
        index = torch.tensor(drawn, device=q.device)
        broken = ~(torch.isfinite(q).all(dim=-1) & (q.amax(dim=-1) > 0))   # NaN logits: the argmax, q one-hot
        one_hot = torch.nn.functional.one_hot(tokens[index], vocab_size).to(q.dtype)
        q = torch.where(broken.unsqueeze(1), one_hot, q)
        tokens = tokens.index_copy(0, index, inverse_cdf(q, uniform_noise(len(drawn), q.device, {}, generator)))
    out: list[tuple[int, torch.Tensor | None]] = [(t, None) for t in tokens.tolist()]
    for n, j in enumerate(drawn):
        out[j] = (out[j][0], q[n])
    return out


def sampled_drafts(reqs: list[Request], device: torch.device) -> SampledDrafts | None:
    """The verification rows of the step's drafts drawn from q (a request with k drafts has rows row .. row + k - 1
    for them and row + k for its bonus token), with their q; None when no request drew any."""
    rows, tokens, probs, row = [], [], [], 0
    for req in reqs:
        drafts = req.spec_token_ids
        if drafts and req.spec_draft_probs is not None:
            if req.spec_draft_probs.shape[0] < len(drafts):
                raise RuntimeError(f"request {req.request_id} has {len(drafts)} drafts but "
                                   f"{req.spec_draft_probs.shape[0]} distributions they were drawn from")
            rows.extend(range(row, row + len(drafts)))
            tokens.extend(drafts)
            probs.append(req.spec_draft_probs[:len(drafts)])   # the scheduler may have cut drafts off the end
        row += len(drafts) + 1
    if not rows:
        return None
    return SampledDrafts(torch.tensor(rows, device=device), torch.tensor(tokens, device=device),
                         torch.cat(probs).to(device))
