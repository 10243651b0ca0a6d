"""SamplingMetadata: the batch's sampling settings as padded device tensors, built once per step."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.errors import InvalidRequestError
from kvserve.sample.constraints import banned_by_bad_words
from kvserve.transfer import to_device
from kvserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence that samples a token this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Per request, seeded from params.seed, kept across steps; on another device than the logits', the sampler
    # draws there and copies.
    generator: torch.Generator | None = None
    eos_token_ids: set[int] = field(default_factory=set)


@dataclass
class SparseLogits:
    """Entries of the [B, V] logits to change, as unique flat indices row * V + token."""

    flat_ids: torch.Tensor              # [N] long
    values: torch.Tensor | None = None  # [N] float; None: the caller's constant


@dataclass
class PenaltyTensors:
    """Repetition, frequency and presence penalties with the tokens they count."""

    prompt_token_ids: torch.Tensor | None  # [B, Lp] long padded with vocab_size; None: no repetition penalty
    output_token_ids: torch.Tensor         # [B, Lo] long padded with vocab_size
    repetition: torch.Tensor               # [B] float, 1.0 = off
    frequency: torch.Tensor                # [B] float, 0.0 = off
    presence: torch.Tensor                 # [B] float, 0.0 = off


@dataclass
class SampledDrafts:
    """Rows that verify a draft drawn from a known distribution q (speculative decoding with a draft model)."""

    rows: torch.Tensor        # [R] long: the rows of the batch
    token_ids: torch.Tensor   # [R] long: the draft each row verifies
    probs: torch.Tensor       # [R, V] float: q, the distribution each draft was drawn from


@dataclass
class SamplingMetadata:
    """Per-step sampling settings of a batch; a feature no row uses is None (its work is skipped)."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None      # [B] bool; None when all_greedy or all_random
    temperature: torch.Tensor | None    # [B] float, greedy rows hold 1.0; None when all_greedy
    top_k: torch.Tensor | None          # [B] long, vocab_size = off
    top_p: torch.Tensor | None          # [B] float, 1.0 = off
    min_p: torch.Tensor | None          # [B] float, 0.0 = off
    generators: dict[int, torch.Generator]  # row index -> generator, random rows only
    generator: torch.Generator | None       # for random rows without a seed; None: torch's default
    logit_bias: SparseLogits | None
    banned: SparseLogits | None         # tokens forced to -inf this step: min_tokens' stop tokens, bad words
    allowed: AllowedTokens | None       # rows sampling among their allowed_token_ids only
    penalties: PenaltyTensors | None
    max_num_logprobs: int | None        # K; None: no row asked for logprobs
    grammar_bitmask: object | None = None   # structured outputs: a GrammarBitmask, set by the model runner
    sampled_drafts: SampledDrafts | None = None   # random rows verifying drawn drafts, set by the model runner

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str,
              generator: torch.Generator | None = None) -> "SamplingMetadata":
        """Gather the rows' settings into batched tensors on `device`."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]
        all_greedy, any_greedy = all(greedy), any(greedy)
        # a setting no row uses costs one look at each row's params, not a pass building its values
        random = not all_greedy   # top-k, top-p, min-p and generators are the random rows' only
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=not any_greedy,
            is_greedy=_tensor(greedy, torch.bool, device) if any_greedy and random else None,
            temperature=_temperature(rows, device) if random else None,
            top_k=_top_k(rows, vocab_size, device) if random else None,
            top_p=_float_or_none(rows, lambda p: p.top_p, 1.0, device) if random else None,
            min_p=_float_or_none(rows, lambda p: p.min_p, 0.0, device) if random else None,
            generators={i: r.generator for i, r in enumerate(rows)
                        if r.generator is not None and not r.params.is_greedy} if random else {},
            generator=generator,
            logit_bias=_logit_bias(rows, vocab_size, device) if any(p.logit_bias for p in params) else None,
            banned=(_banned(rows, vocab_size, device) if any(p.min_tokens or p.bad_words_token_ids for p in params)
                    else None),
            allowed=_allowed(rows, vocab_size, device) if any(p.allowed_ids is not None for p in params) else None,
            penalties=_penalties(rows, vocab_size, device),
            max_num_logprobs=_max_num_logprobs(rows, vocab_size),
        )


def _tensor(data, dtype: torch.dtype, device) -> torch.Tensor:
    return to_device(data, dtype, device)


def _temperature(rows: list[SamplingRow], device) -> torch.Tensor:
    # Greedy rows divide by 1.0 so the shared random path never sees 0; their result is discarded.
    return _tensor([1.0 if r.params.is_greedy else r.params.temperature for r in rows], torch.float32, device)


def _top_k(rows: list[SamplingRow], vocab_size: int, device) -> torch.Tensor | None:
    ks = [vocab_size if r.params.is_greedy or r.params.top_k == 0 else min(r.params.top_k, vocab_size)
          for r in rows]
    return _tensor(ks, torch.long, device) if any(k < vocab_size for k in ks) else None


def _float_or_none(rows: list[SamplingRow], get, off: float, device) -> torch.Tensor | None:
    values = [off if r.params.is_greedy else float(get(r.params)) for r in rows]
    return _tensor(values, torch.float32, device) if any(v != off for v in values) else None


def _check_ids(ids, vocab_size: int, param: str) -> None:
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"{param} has a token id outside the vocabulary [0, {vocab_size})", param)


def _logit_bias(rows: list[SamplingRow], vocab_size: int, device) -> SparseLogits | None:
    flat_ids, values = [], []
    for i, r in enumerate(rows):
        bias = r.params.logit_bias or {}
        _check_ids(bias, vocab_size, "logit_bias")
        flat_ids += [i * vocab_size + t for t in bias]
        values += bias.values()
    if not flat_ids:
        return None
    return SparseLogits(_tensor(flat_ids, torch.long, device), _tensor(values, torch.float32, device))


def _banned(rows: list[SamplingRow], vocab_size: int, device) -> SparseLogits | None:
    flat_ids = []
    for i, r in enumerate(rows):
        p, banned = r.params, set()
        # a constrained row bans the stop tokens in its grammar bitmask, unless nothing else is allowed; ignore_eos
        # only stops eos from ending the request: while under min_tokens eos stays forbidden
        if len(r.output_token_ids) < p.min_tokens and p.structured_outputs is None:
            banned = set(r.eos_token_ids) | p.all_stop_token_ids
            _check_ids(banned, vocab_size, "stop_token_ids")
        words = banned_by_bad_words(p.bad_words_token_ids, r.output_token_ids) - banned
        if words and p.allowed_token_ids is not None and set(p.allowed_token_ids) <= banned | words:
            # the words of several tokens that would leave nothing to sample stay allowed this step (admission
            # refuses a request that one-token words or min_tokens leave nothing: check_allowed_tokens)
            words = banned_by_bad_words(p.bad_words_token_ids, []) - banned   # the one-token words
        flat_ids += [i * vocab_size + t for t in sorted(banned | {t for t in words if t < vocab_size})]
    if not flat_ids:
        return None
    return SparseLogits(_tensor(flat_ids, torch.long, device))


@dataclass
class AllowedTokens:
    """Rows restricted to their allowed_token_ids: every other entry of those rows is set to -inf."""

    rows: torch.Tensor   # [R] long
    keep: torch.Tensor   # [R, V] bool


def _allowed(rows: list[SamplingRow], vocab_size: int, device) -> AllowedTokens:
    """The rows' masks, built where the logits are from their ids alone (no [R, V] copy from the host), from the
    arrays their params built once (SamplingParams.allowed_ids)."""
    which = [i for i, r in enumerate(rows) if r.params.allowed_ids is not None]
    parts = []
    for j, i in enumerate(which):
        ids = rows[i].params.allowed_ids
        _check_ids((int(ids[0]), int(ids[-1])), vocab_size, "allowed_token_ids")   # sorted: its ends suffice
        parts.append(ids + j * vocab_size)
    keep = torch.zeros(len(which) * vocab_size, dtype=torch.bool, device=device)
    keep[to_device(np.concatenate(parts), torch.long, device)] = True
    return AllowedTokens(_tensor(which, torch.long, device), keep.view(len(which), vocab_size))


def _penalties(rows: list[SamplingRow], vocab_size: int, device) -> PenaltyTensors | None:
    params = [r.params for r in rows]
    has_rep = [p.repetition_penalty != 1.0 for p in params]
    has_any = [h or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for h, p in zip(has_rep, params)]
    if not any(has_any):
        return None
    # Rows without a penalty contribute no tokens: their pad-only rows make the counts all zero.
    prompts = [r.prompt_token_ids if h else [] for r, h in zip(rows, has_rep)] if any(has_rep) else None
    outputs = [r.output_token_ids if h else [] for r, h in zip(rows, has_any)]
    return PenaltyTensors(
        prompt_token_ids=_padded(prompts, vocab_size, device) if prompts is not None else None,
        output_token_ids=_padded(outputs, vocab_size, device),
        repetition=_tensor([p.repetition_penalty for p in params], torch.float32, device),
        frequency=_tensor([p.frequency_penalty for p in params], torch.float32, device),
        presence=_tensor([p.presence_penalty for p in params], torch.float32, device),
    )


def _padded(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    """[B, max len] long tensor of the lists, right-padded with `pad`."""
    out = np.full((len(lists), max((len(x) for x in lists), default=0)), pad, dtype=np.int64)
    for i, ids in enumerate(lists):
        out[i, :len(ids)] = ids
    return to_device(out, torch.long, device)


def _max_num_logprobs(rows: list[SamplingRow], vocab_size: int) -> int | None:
    ks = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    return min(max(ks), vocab_size) if ks else None
