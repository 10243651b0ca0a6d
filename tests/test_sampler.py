"""Batched sampler on synthetic logits: processors, truncation, seeds, distributions, logprobs."""
import math

import pytest
import torch

from kvserve import kernels
from kvserve.errors import InvalidRequestError
from kvserve.sample import (LogprobsTensors, Sampler, SamplerOutput, SamplingMetadata, SamplingRow,
                            compute_prompt_logprobs)
from kvserve.sample.logits_processors import apply_logits_processors
from kvserve.sample.sampler import argmax_rows
from kvserve.sample.truncation import apply_min_p, apply_top_k_top_p
from kvserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")

# Chi-square critical values at p = 0.001 by degrees of freedom (no scipy dependency).
CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def row(prompt=(), output=(), seed=None, eos=(), **params) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params=SamplingParams(seed=seed, **params), prompt_token_ids=list(prompt),
                       output_token_ids=list(output), generator=generator, eos_token_ids=set(eos))


def run(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    return Sampler()(logits, SamplingMetadata.build(rows, logits.shape[1], CPU))


def processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return apply_logits_processors(logits, SamplingMetadata.build(rows, logits.shape[1], CPU))


def reference_probs(logits: list[float], temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """Plain-Python oracle: softmax(l/T), min-p, top-k, top-p (smallest set with mass >= p), renormalized."""
    exps = [math.exp(x / temperature) for x in logits]
    probs = [e / sum(exps) for e in exps]
    keep = [p >= min_p * max(probs) for p in probs]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    order = [i for i in order if keep[i]][: top_k or None]
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += probs[i] / sum(probs[j] for j in order)
        if mass >= top_p:
            break
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def chi_square(counts: torch.Tensor, expected_probs: list[float]) -> tuple[float, int]:
    n = int(counts.sum())
    support = [i for i, p in enumerate(expected_probs) if p > 0]
    stat = sum((float(counts[i]) - n * expected_probs[i]) ** 2 / (n * expected_probs[i]) for i in support)
    return stat, len(support) - 1


# --- greedy ---------------------------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = run(logits, [row(temperature=0.0) for _ in range(6)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_ignore_truncation_in_mixed_batch():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    rows = [row(temperature=0.0, top_k=5, top_p=0.1, min_p=0.9) if i % 2 == 0 else row(temperature=1.5)
            for i in range(8)]
    out = run(logits, rows)
    assert torch.equal(out.sampled_token_ids[::2], logits[::2].argmax(-1))


def test_logits_are_not_modified():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    run(logits, [row(temperature=0.7, top_k=3, top_p=0.5, min_p=0.1, logit_bias={1: 5.0}, min_tokens=2,
                     eos=[0], repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5,
                     prompt=[3], output=[4], logprobs=2)] * 3)
    assert torch.equal(logits, before)


def test_empty_batch():
    out = run(torch.empty(0, 10), [])
    assert out.sampled_token_ids.shape == (0,)


def test_shape_mismatch_raises():
    meta = SamplingMetadata.build([row()], 10, CPU)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, 12), meta)


# --- truncation -----------------------------------------------------------------------------------

def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 3.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert torch.isfinite(out).sum(-1).tolist() == [2, 4]
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) <= {1, 2, 3, 4}
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


def test_top_k_sampling_only_draws_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.5, 0.5, 1.9, -1.0, 0.1]]).repeat(4000, 1)
    torch.manual_seed(0)
    out = run(logits, [row(temperature=5.0, top_k=3)] * 4000)
    assert set(out.sampled_token_ids.tolist()) == {1, 3, 5}


def test_top_p_keeps_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log().repeat(5, 1)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.4, 0.75, 0.85, 0.99, 1.0]))
    kept = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in out]
    assert kept == [{1}, {1, 3}, {1, 3, 2}, {0, 1, 2, 3}, {0, 1, 2, 3}]


def test_top_p_one_keeps_negligible_tokens():
    logits = torch.cat([torch.tensor([[50.0]]), torch.full((1, 999), -50.0)], dim=1)
    out = apply_top_k_top_p(logits, torch.tensor([1000]), torch.tensor([1.0]))
    assert torch.isfinite(out).all()


def test_top_k_then_top_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=2 renormalizes to (4/7, 3/7); top_p=0.5 then keeps only token 0 (mass 0.571 >= 0.5).
    out = apply_top_k_top_p(probs.log().unsqueeze(0), torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    # without top_k, 0.4 < 0.5, so two tokens are needed
    out = apply_top_k_top_p(probs.log().unsqueeze(0), None, torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log().repeat(3, 1)
    out = apply_min_p(logits, torch.tensor([0.0, 0.2, 0.5]))  # thresholds 0, 0.1, 0.25
    assert torch.isfinite(out).tolist() == [[True] * 4, [True, True, False, True], [False, True, False, True]]


# --- logits processors: bias, min_tokens, penalties ----------------------------------------------

BASE = [2.0, -1.0, 0.5, 3.0, -2.0]


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([BASE, BASE])
    # token 0 in the prompt, 1 and 2 in the output: positive logits / 2, negative * 2
    out = processed(logits, [row(prompt=[0], output=[1, 1, 2], repetition_penalty=2.0), row(prompt=[0])])
    assert torch.allclose(out[0], torch.tensor([1.0, -2.0, 0.25, 3.0, -2.0]))
    assert torch.equal(out[1], logits[1])


def test_frequency_penalty_hand_computed():
    logits = torch.tensor([BASE])
    # prompt tokens do not count toward frequency
    out = processed(logits, [row(prompt=[3, 3], output=[1, 1, 2], frequency_penalty=0.5)])
    assert torch.allclose(out[0], torch.tensor([2.0, -2.0, 0.0, 3.0, -2.0]))


def test_presence_penalty_hand_computed():
    logits = torch.tensor([BASE])
    out = processed(logits, [row(prompt=[3], output=[1, 1, 2], presence_penalty=-0.25)])
    assert torch.allclose(out[0], torch.tensor([2.0, -0.75, 0.75, 3.0, -2.0]))


def test_all_penalties_combined_in_order():
    logits = torch.tensor([BASE, BASE])
    rows = [row(prompt=[0], output=[1, 1, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            row(prompt=[4], output=[3], repetition_penalty=0.5)]
    out = processed(logits, rows)
    # row 0: repetition -> [1, -2, 0.25, 3, -2]; frequency 0.5*[0,2,1,0,0]; presence 0.25*[0,1,1,0,0]
    assert torch.allclose(out[0], torch.tensor([1.0, -3.25, -0.5, 3.0, -2.0]))
    # row 1: penalty 0.5 rewards seen tokens: 3 -> 6, -2 -> -1
    assert torch.allclose(out[1], torch.tensor([2.0, -1.0, 0.5, 6.0, -1.0]))


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert run(logits, [row(temperature=0.0, output=[0])]).sampled_token_ids.tolist() == [0]
    assert run(logits, [row(temperature=0.0, output=[0], presence_penalty=0.2)]).sampled_token_ids.tolist() == [1]


def test_no_penalties_builds_no_penalty_tensors():
    meta = SamplingMetadata.build([row(prompt=[1, 2], output=[3])], 10, CPU)
    assert meta.penalties is None and meta.logit_bias is None and meta.banned is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None and meta.temperature is not None
    meta = SamplingMetadata.build([row(frequency_penalty=0.1, output=[3])], 10, CPU)
    assert meta.penalties.prompt_token_ids is None  # only repetition needs the prompt


def test_logit_bias_forces_a_token():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    for _ in range(5):
        out = run(logits, [row(temperature=0.0, logit_bias={7: 100.0}), row(temperature=1.0, logit_bias={9: 100.0}),
                           row(temperature=0.0)])
        assert out.sampled_token_ids.tolist() == [7, 9, int(logits[2].argmax())]


def test_logit_bias_is_added():
    out = processed(torch.tensor([BASE]), [row(logit_bias={1: 1.5, 4: -3.0})])
    assert torch.allclose(out[0], torch.tensor([2.0, 0.5, 0.5, 3.0, -5.0]))


def test_logit_bias_out_of_vocab_raises():
    with pytest.raises(InvalidRequestError) as e:
        SamplingMetadata.build([row(logit_bias={10: 1.0})], 10, CPU)
    assert e.value.param == "logit_bias"


def test_min_tokens_blocks_eos_and_stop_ids_then_releases():
    logits = torch.tensor([[0.0, 1.0, 0.0, 9.0, 8.0, 7.0]])  # eos 3, stop id 4, then 5
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[4], eos=[3])
    assert run(logits, [row(output=[], **params)]).sampled_token_ids.tolist() == [5]
    assert run(logits, [row(output=[1], **params)]).sampled_token_ids.tolist() == [5]
    assert run(logits, [row(output=[1, 1], **params)]).sampled_token_ids.tolist() == [3]
    out = processed(logits, [row(output=[1], **params)])
    assert out[0].tolist() == [0.0, 1.0, 0.0, NEG_INF, NEG_INF, 7.0]


def test_min_tokens_applies_to_random_rows():
    logits = torch.tensor([[0.0, 0.0, 10.0, 10.0]]).repeat(500, 1)
    torch.manual_seed(4)
    out = run(logits, [row(temperature=1.0, min_tokens=1, stop_token_ids=[3], eos=[2])] * 500)
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


def test_ignore_eos_does_not_mask_eos():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert run(logits, [row(temperature=0.0, ignore_eos=True, eos=[1])]).sampled_token_ids.tolist() == [1]


# --- seeds ----------------------------------------------------------------------------------------

def seeded_tokens(seed: int, position: int, others: list, steps: int = 12, vocab: int = 500) -> list[int]:
    """Tokens a seeded row samples over `steps`, placed at `position` among `others` rows."""
    logits_gen = torch.Generator().manual_seed(99)
    target = row(temperature=1.0, seed=seed)
    rows = others[:position] + [target] + others[position:]
    tokens = []
    for _ in range(steps):
        logits = torch.randn(len(rows), vocab, generator=logits_gen)
        logits[position] = torch.linspace(-1.0, 1.0, vocab)  # the target's logits are the same every run
        tokens.append(run(logits, rows).sampled_token_ids[position].item())
    return tokens


def test_same_seed_same_tokens_in_any_batch():
    alone = seeded_tokens(1234, 0, [])
    torch.manual_seed(5)
    others = [row(temperature=0.8, seed=7), row(temperature=0.0), row(temperature=1.0, top_k=5),
              row(temperature=1.3)]
    in_batch = seeded_tokens(1234, 2, others)
    torch.manual_seed(6)
    at_end = seeded_tokens(1234, 4, [row(temperature=0.5) for _ in range(4)])
    assert alone == in_batch == at_end


def test_different_seeds_differ():
    assert seeded_tokens(1, 0, []) != seeded_tokens(2, 0, [])


def test_unseeded_rows_follow_global_seed():
    logits = torch.zeros(4, 1000)
    torch.manual_seed(8)
    a = run(logits, [row()] * 4).sampled_token_ids
    torch.manual_seed(8)
    b = run(logits, [row()] * 4).sampled_token_ids
    assert torch.equal(a, b) and len(set(a.tolist())) > 1


# --- distributions --------------------------------------------------------------------------------

# Deliberately unsorted, so a truncation that forgets to sort shows up.
DIST_LOGITS = [0.5, 2.0, -1.0, 1.5, 0.0, 1.0, -1.5, -0.5]


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7, top_k=5),
    dict(temperature=0.8, top_p=0.85),
    dict(temperature=1.2, top_k=6, top_p=0.8),
    dict(temperature=1.5, min_p=0.15),
])
def test_sampled_frequencies_match_truncated_softmax(params):
    num_samples = 20000
    logits = torch.tensor([DIST_LOGITS]).repeat(num_samples, 1)
    torch.manual_seed(10)
    out = run(logits, [row(**params)] * num_samples)
    counts = torch.bincount(out.sampled_token_ids, minlength=len(DIST_LOGITS))
    expected = reference_probs(DIST_LOGITS, **params)
    assert all(counts[i] == 0 for i, p in enumerate(expected) if p == 0)
    stat, dof = chi_square(counts, expected)
    assert stat < CHI2_CRIT_001[dof], (stat, counts.tolist(), expected)


def test_seeded_rows_follow_the_distribution():
    num_rows, params = 3000, dict(temperature=0.9, top_k=6)
    logits = torch.tensor([DIST_LOGITS]).repeat(num_rows, 1)
    out = run(logits, [row(seed=1000 + i, **params) for i in range(num_rows)])
    counts = torch.bincount(out.sampled_token_ids, minlength=len(DIST_LOGITS))
    stat, dof = chi_square(counts, reference_probs(DIST_LOGITS, **params))
    assert stat < CHI2_CRIT_001[dof]


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([DIST_LOGITS]).repeat(4000, 1)
    torch.manual_seed(11)
    cold = run(logits, [row(temperature=0.1)] * 4000).sampled_token_ids
    hot = run(logits, [row(temperature=100.0)] * 4000).sampled_token_ids
    assert (cold == 1).float().mean() > 0.99
    assert torch.bincount(hot, minlength=8).min() > 400  # ~500 each when nearly uniform


# --- logprobs -------------------------------------------------------------------------------------

def test_logprobs_are_raw_and_ranked():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(12))
    rows = [row(temperature=3.0, logprobs=2, top_k=30, repetition_penalty=1.8, prompt=[0, 1, 2]),
            row(temperature=0.0, logprobs=4, logit_bias={5: 50.0}),
            row(temperature=0.5)]
    torch.manual_seed(13)
    out = run(logits, rows)
    lp = out.logprobs
    assert isinstance(lp, LogprobsTensors)
    assert lp.token_ids.shape == (3, 5) and lp.logprobs.shape == (3, 5) and lp.ranks.shape == (3,)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    assert out.sampled_token_ids[1] == 5
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    top_vals, top_ids = raw.topk(4, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    assert torch.allclose(lp.logprobs[:, 1:], top_vals)
    assert (lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:]).all()
    expected_ranks = [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(out.sampled_token_ids.tolist())]
    assert lp.ranks.tolist() == expected_ranks


def test_logprobs_rank_one_for_greedy():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(14))
    out = run(logits, [row(temperature=0.0, logprobs=0)] * 4)
    assert out.logprobs.token_ids.shape == (4, 1)
    assert out.logprobs.ranks.tolist() == [1, 1, 1, 1]


def test_prompt_logprobs():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(15))
    targets = torch.tensor([3, 0, 29, 7, 7])
    lp = compute_prompt_logprobs(logits, targets, 3)
    raw = torch.log_softmax(logits, dim=-1)
    assert lp.token_ids[:, 0].tolist() == targets.tolist()
    assert torch.allclose(lp.logprobs[:, 0], raw[torch.arange(5), targets])
    assert torch.equal(lp.token_ids[:, 1:], raw.topk(3, dim=-1).indices)
    assert torch.allclose(lp.logprobs[:, 1:], raw.topk(3, dim=-1).values)
    assert lp.ranks.tolist() == [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(targets.tolist())]


def test_prompt_logprobs_computed_in_float32():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    lp = compute_prompt_logprobs(logits, torch.tensor([1, 2]), 0)
    assert lp.logprobs.dtype == torch.float32 and lp.token_ids.shape == (2, 1)


def test_non_contiguous_logits():
    padded = torch.randn(2, 12, generator=torch.Generator().manual_seed(17))
    logits = padded[:, :10]  # a vocab-padded model's logits, sliced: not contiguous
    out = processed(logits, [row(logit_bias={3: 1.0}, min_tokens=1, eos=[4]), row(logit_bias={5: -2.0})])
    expected = logits.clone()
    expected[0, 3] += 1.0
    expected[0, 4] = NEG_INF
    expected[1, 5] -= 2.0
    assert torch.equal(out, expected)


@pytest.mark.skipif(kernels.load() is None, reason="the C++ kernels do not build here")
@pytest.mark.parametrize("vocab", [1, 5, 16, 31, 32, 33, 100, 49152])
def test_argmax_kernel_matches_torch_argmax(vocab):
    """First maximum on ties, NaN counts as the maximum (first NaN wins), -inf rows, inf twice, strided rows."""
    torch.manual_seed(vocab)
    x = torch.randn(7, vocab + 3)[:, :vocab]   # rows strided past V
    x[1] = 3.0
    x[2] = float("-inf")
    if vocab > 3:
        x[3, vocab // 2] = x[3, vocab - 1] = float("nan")
    x[4] = torch.randint(0, 3, (vocab,)).float()
    if vocab > 20:
        x[5, 20] = x[5, vocab - 1] = float("inf")
    if vocab > 40:
        x[6, 35] = float("nan")   # a NaN in the vector part, past a larger value
        x[6, 3] = 100.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, vocab)).shape == (0,)


def test_seeded_rows_draw_on_their_generators_device_and_copy():
    """Request generators live on the CPU; on another device (CUDA in serving, the meta device here) a seeded row
    must not hand its CPU generator to an op on that device, which raises and would fail the whole step."""
    from kvserve.sample.sampler import draw_uniform, uniform_noise
    u = uniform_noise(3, "meta", {1: torch.Generator().manual_seed(7)})
    assert u.device.type == "meta" and u.shape == (3,)
    cpu = uniform_noise(3, "cpu", {1: torch.Generator().manual_seed(7)})
    assert cpu[1] == draw_uniform(torch.Generator().manual_seed(7))


def test_unseeded_rows_draw_from_the_given_generator():
    meta = SamplingMetadata.build([row(temperature=1.0) for _ in range(4)], 50, "cpu",
                                  torch.Generator().manual_seed(5))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    first = Sampler()(logits, meta).sampled_token_ids
    meta.generator.manual_seed(5)
    assert torch.equal(Sampler()(logits, meta).sampled_token_ids, first)


def test_inverse_cdf_splits_the_unit_interval_by_weight():
    from kvserve.sample.sampler import inverse_cdf
    w = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    draws = {0.0: [1, 0, 4], 0.25 - 1e-12: [1, 0, 4], 0.25: [3, 0, 4], 1 - 1e-15: [3, 0, 4]}
    for u, want in draws.items():   # tokens of weight 0 span nothing: never drawn, at either end either
        assert inverse_cdf(w, torch.full((3,), u, dtype=torch.float64)).tolist() == want, u
