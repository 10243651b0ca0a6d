"""Verification of drafts on synthetic distributions, deterministic ones and ones drawn from a distribution q: the
emitted tokens are distributed as the target's p at every position, through the accepted, recovered and bonus
paths (chi-square over 100k draws)."""
import numpy as np
import pytest
import torch

from kvserve.sample import Sampler, SamplingMetadata, SamplingRow
from kvserve.sample.metadata import SampledDrafts
from kvserve.sampling_params import SamplingParams
from kvserve.worker.model_runner import accepted_length

V, K, N = 8, 2, 100_000
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}   # 99.9% quantiles by dof


def chi_square(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    expected = probs * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def processed(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """p: the target's distribution after temperature and top-k, as the sampler computes it."""
    scaled = logits / params.temperature
    if params.top_k:
        scaled[scaled < scaled.topk(params.top_k, dim=-1).values[:, -1:]] = -torch.inf
    return scaled.softmax(-1).double().numpy()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6)],
                         ids=["plain", "temperature-top-k"])
def test_emitted_tokens_follow_the_target_distribution(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(K + 1, V, generator=g) * 1.5     # one target distribution per position
    drafts = [int(logits[0].argmax()), int(logits[1].argsort()[-3])]   # a likely draft, then a less likely one
    rows = [SamplingRow(params, [1], [])] * (N * (K + 1))
    meta = SamplingMetadata.build(rows, V, "cpu", torch.Generator().manual_seed(1))
    sampled = Sampler()(logits.repeat(N, 1), meta).sampled_token_ids.view(N, K + 1).tolist()
    emitted = [row[:accepted_length(drafts, row[:K]) + 1] for row in sampled]

    p = processed(logits, params)
    first = np.array([e[0] for e in emitted])
    assert chi_square(first, p[0]) < CHI2_999[V - 1]                     # every draw, whatever the draft
    accepted = np.array([len(e) > 1 for e in emitted])
    assert abs(accepted.mean() - p[0][drafts[0]]) < 4 * np.sqrt(p[0][drafts[0]] / N)   # accepted w.p. p(d)
    recovered = first[~accepted]                                         # norm(max(0, p - q)), q one-hot at d
    q_residual = p[0].copy()
    q_residual[drafts[0]] = 0
    dof = int((q_residual > 0).sum()) - 1
    assert chi_square(recovered, q_residual / q_residual.sum()) < CHI2_999[dof]
    second = np.array([e[1] for e in emitted if len(e) > 1])
    assert chi_square(second, p[1]) < CHI2_999[int((p[1] > 0).sum()) - 1]
    bonus = np.array([e[2] for e in emitted if len(e) > 2])              # both drafts accepted
    assert len(bonus) > 1000
    assert chi_square(bonus, p[2]) < CHI2_999[int((p[2] > 0).sum()) - 1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6)],
                         ids=["plain", "temperature-top-k"])
def test_drafts_drawn_from_q_leave_the_target_distribution(params):
    # k = 3 drafts, each drawn from its own random q (one token of q_1 has probability 0); row j keeps its draft
    # with probability min(1, p/q), else draws from norm(max(0, p - q))
    k = 3
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(k + 1, V, generator=g) * 1.5
    q = torch.rand(k, V, generator=g) ** 2
    q[1, 3] = 0
    q /= q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], 1)
    rows = [SamplingRow(params, [1], [])] * (N * (k + 1))
    meta = SamplingMetadata.build(rows, V, "cpu", torch.Generator().manual_seed(1))
    draft_rows = (torch.arange(N).unsqueeze(1) * (k + 1) + torch.arange(k)).flatten()
    meta.sampled_drafts = SampledDrafts(draft_rows, drafts.flatten(), q.repeat(N, 1))
    sampled = Sampler()(logits.repeat(N, 1), meta).sampled_token_ids.view(N, k + 1).tolist()
    drafts = drafts.tolist()
    emitted = [row[:accepted_length(d, row[:k]) + 1] for d, row in zip(drafts, sampled)]

    p = processed(logits, params)
    for j in range(k + 1):   # the j-th token of every request that emitted one: after j accepted drafts
        tokens = np.array([e[j] for e in emitted if len(e) > j])
        assert len(tokens) > 2000, j
        assert chi_square(tokens, p[j]) < CHI2_999[int((p[j] > 0).sum()) - 1], j
    accepted = np.array([len(e) > 1 for e in emitted])
    rate = np.minimum(p[0], q[0].double().numpy()).sum()              # sum_x min(p, q), not q's E[p(d)]
    assert abs(accepted.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / N)
    first = np.array([e[0] for e in emitted])
    residual = np.maximum(p[0] - q[0].double().numpy(), 0)
    assert chi_square(first[~accepted], residual / residual.sum()) < CHI2_999[int((residual > 0).sum()) - 1]


def test_accepted_length():
    assert accepted_length([], [5]) == 0
    assert accepted_length([1, 2, 3], [1, 2, 3]) == 3
    assert accepted_length([1, 2, 3], [1, 4, 3]) == 1
    assert accepted_length([1, 2, 3], [7, 2, 3]) == 0


def test_verification_rows_take_each_requests_drawn_drafts_and_their_q():
    # a request's k drafts take rows row .. row + k - 1, its bonus row + k; drafts the scheduler cut off the end
    # keep their first q rows; argmax drafts (q None) and requests without drafts add no row
    from kvserve.core.request import Request
    from kvserve.spec_decode.draft_sampling import sampled_drafts
    reqs = [Request(str(i), [1, 2], SamplingParams(temperature=1.0)) for i in range(4)]
    q = [torch.rand(3, V) for _ in reqs]
    reqs[0].spec_token_ids, reqs[0].spec_draft_probs = [5, 6], q[0]          # 3 drafts, the last one cut off
    reqs[2].spec_token_ids = [1, 2]                                          # argmax drafts
    reqs[3].spec_token_ids, reqs[3].spec_draft_probs = [7, 4, 3], q[3]
    d = sampled_drafts(reqs, "cpu")
    assert d.rows.tolist() == [0, 1, 7, 8, 9] and d.token_ids.tolist() == [5, 6, 7, 4, 3]
    assert torch.equal(d.probs, torch.cat([q[0][:2], q[3]]))
    reqs[0].spec_draft_probs = q[0][:1]
    with pytest.raises(RuntimeError, match="has 2 drafts but 1"):
        sampled_drafts(reqs, "cpu")
    reqs[0].drop_drafts()
    assert reqs[0].spec_draft_probs is None and sampled_drafts(reqs[:3], "cpu") is None


def test_next_drafts_with_a_cut_vocabulary_and_broken_logits():
    # a draft with draft_vocab_size N < V gives logits over its first N tokens: q is zero past N and sums to 1,
    # and draws follow q; greedy requests take the argmax (no q); a row of NaN logits falls back to its argmax
    # with a one-hot q, leaving the other rows alone
    from kvserve.core.request import Request
    from kvserve.spec_decode.draft_sampling import next_drafts
    cut, draws = 5, 10_000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, cut, generator=gen) * 2
    logits[2] = torch.nan
    reqs = [Request("drawn", [1, 2], SamplingParams(temperature=0.8)),
            Request("greedy", [1, 2], SamplingParams(temperature=0.0)),
            Request("broken", [1, 2], SamplingParams(temperature=1.0))]
    out = next_drafts(logits, reqs, [[], [3], []], V, gen)
    (token, q), (greedy, no_q), (fallback, one_hot) = out
    assert no_q is None and greedy == int(logits[1].argmax())
    want = torch.zeros(V)
    want[:cut] = (logits[0] / 0.8).softmax(-1)
    assert token < cut and torch.allclose(q, want, atol=1e-6) and abs(float(q.sum()) - 1) < 1e-6
    assert torch.equal(one_hot, torch.nn.functional.one_hot(torch.tensor(fallback), V).float())
    assert 0 <= fallback < cut
    samples = np.array([t for t, _ in next_drafts(logits[:1].expand(draws, cut), reqs[:1] * draws, [[]] * draws, V,
                                                  gen)])
    assert chi_square(samples, want.double().numpy()) < CHI2_999[cut - 1]
