"""Speculative decoding with a draft model: on a random tiny target and a draft made of its first layer (conftest's
tiny_pair), the output equals the output without speculation (batched, chunked, preempted, prefix-cached, seeded
sampling), drafts drawn from the draft's distribution keep the target's, the draft's KV stays right through
accepted and rejected drafts; its vocabulary cut to the first token ids and each request's own (draft_vocab_size);
drafts refused at start unless they share the vocabulary and are smaller. Its matrices in other formats:
test_spec_draft_weights.py."""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from kvserve import SamplingParams
from kvserve.errors import InvalidRequestError

from model_utils import save_tiny_model
from spec_utils import GREEDY, GREEDY_30, STRESS, make_llm, save_first_layer_draft, tiny_prompts, tokens


@pytest.mark.parametrize("config", [{}, STRESS], ids=["batched", "chunked-preempted-cached"])
def test_draft_model_greedy_equals_no_speculation(tiny_pair, greedy_reference, gguf_path, config):
    target, draft = tiny_pair
    (prompts, want), params = greedy_reference, GREEDY_30
    spec = {"model": draft, "num_speculative_tokens": 4, "disable_by_batch_size": None}
    llm = make_llm(spec, model=target, tokenizer=gguf_path, **config)
    got = tokens(llm.generate(prompts + prompts, params, use_tqdm=False))
    assert got == want + want
    stats = llm.llm_engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if config:
        assert llm.llm_engine.scheduler.num_preemptions > 0
        for _ in range(2):   # the second time from the prefix cache
            assert tokens(llm.generate(prompts[-1:], params, use_tqdm=False)) == want[-1:]
        assert llm.llm_engine.scheduler.prefix_cache_hits > 0
    seeded = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=30, ignore_eos=True)
    assert tokens(llm.generate(prompts, seeded, use_tqdm=False)) == \
        tokens(make_llm(model=target, tokenizer=gguf_path).generate(prompts, seeded, use_tqdm=False))


def vocab_rule(prompt: list[int], out: list[int], cut: int = 48) -> tuple[set[int], bool]:
    """The request's own ids past the cut (its prompt's and output's), and whether it drafts from the whole
    vocabulary: once 2 of its output tokens, and 1 in 32 of them, were past the cut and new to it."""
    own, new = {t for t in prompt if t >= cut}, 0
    for t in out:
        if t >= cut and t not in own:
            own.add(t)
            new += 1
    return own, new >= 2 and 32 * new >= len(out)


@pytest.mark.parametrize("config", [{}, STRESS], ids=["batched", "chunked-preempted-cached"])
def test_draft_vocabulary_of_its_first_ids_keeps_the_output(tiny_pair, greedy_reference, gguf_path, config):
    # the draft proposes among ids < 48 and the request's own ids past them, but from the whole vocabulary for a
    # request whose output brings new ids past the cut (vocab_rule)
    target, draft = tiny_pair
    (prompts, want), params = greedy_reference, GREEDY_30
    assert any(t >= 48 for req in want for seq in req for t in seq)   # ids the cut draft cannot propose
    spec = {"model": draft, "num_speculative_tokens": 4, "disable_by_batch_size": None, "draft_vocab_size": 48}
    llm = make_llm(spec, model=target, tokenizer=gguf_path, **config)
    runner, proposals, batches = llm.llm_engine.runner, [], []
    propose = runner.propose_drafts

    def recording(reqs, max_drafts):
        rules = [vocab_rule(req.prompt_token_ids, list(req.output_token_ids)) for req in reqs]
        try:
            drafts = propose(reqs, max_drafts)
        except Exception as e:   # the engine would go on without drafts: the output alone would not show it
            batches.append(e)
            raise
        proposals.extend(zip(rules, drafts))
        batches.append({whole for (_, whole), d in zip(rules, drafts) if d})
        return drafts
    runner.propose_drafts = recording
    assert tokens(llm.generate(prompts + prompts, params, use_tqdm=False)) == want + want
    if config:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert all(isinstance(b, set) for b in batches) and {False, True} in batches   # a batch of both kinds
    cut = [(own, d) for (own, whole), d in proposals if d and not whole]
    whole = [(own, d) for (own, whole), d in proposals if d and whole]
    assert cut and all(t < 48 or t in own for own, d in cut for t in d)
    assert any(t >= 48 for _, d in cut for t in d)   # the request's own ids past the cut are proposed
    assert any(t >= 48 and t not in own for own, d in whole for t in d)   # the whole head's proposals
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    with pytest.raises(InvalidRequestError, match="exceeds the vocabulary"):
        make_llm({**spec, "draft_vocab_size": 97}, model=target, tokenizer=gguf_path)


def test_a_request_drafts_from_the_whole_vocabulary_while_its_output_brings_new_ids_past_the_cut(tiny_pair,
                                                                                               gguf_path):
    from kvserve.core.request import Request
    target, draft = tiny_pair
    spec = {"model": draft, "num_speculative_tokens": 2, "draft_vocab_size": 48}
    runner = make_llm(spec, model=target, tokenizer=gguf_path).llm_engine.runner
    req = Request("r", [1, 2, 3, 80, 80, 90], SamplingParams(max_tokens=200))
    seen = []
    for out in ([5, 60], [5, 60, 80, 90], [5, 60, 80, 90, 70], [5, 60], [5, 60, 70] + [7] * 61,
                [5, 60, 70] + [7] * 62, [5, 60, 70], [60, 60]):
        del req.output_token_ids[:]   # also as tokens past a stop string are dropped
        req.output_token_ids.extend(out)
        vocab = runner._draft_vocab(req)
        seen.append(None if vocab is None else sorted(vocab.own))
    # 60 is new, 80 and 90 the prompt's: no; 60 and 70 new, 2 of 5 (1 in 32): yes; cut back: no; 2 of 64: yes;
    # 2 of 65: no; cut back, counted again from the prompt: yes; a new id repeated counts once: no
    own = [60, 80, 90]
    assert seen == [own, own, None, own, None, [60, 70, 80, 90], None, own]
    # a batch of three: the whole matrix's row; the cut's and the request's own rows, -inf elsewhere
    from kvserve.spec_decode.draft_vocab import DraftVocab, draft_logits, own_ids
    model = runner.draft_model
    hidden = torch.randn(3, model.config.hidden_size, dtype=model.model.norm.weight.dtype)
    a, b = DraftVocab([1, 50, 60], 48), DraftVocab([2, 60, 95], 48)
    mixed = draft_logits(model, hidden, [a, None, b])
    whole, cut = model.compute_logits(hidden), model.compute_logits(hidden, cut=True)
    assert mixed.shape == (3, 96) and cut.shape == (3, 48)
    torch.testing.assert_close(mixed[1], whole[1], rtol=1e-5, atol=1e-5)
    for row, ids in ((0, [50, 60]), (2, [60, 95])):
        torch.testing.assert_close(mixed[row, :48], cut[row], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed[row, ids], whole[row, ids], rtol=1e-5, atol=1e-5)
        rest = [t for t in range(48, 96) if t not in ids]
        assert torch.all(mixed[row, rest] == -torch.inf)
    assert draft_logits(model, hidden, [DraftVocab([1], 48)] * 3).shape == (3, 48)   # nothing past the cut
    alone = draft_logits(model, hidden[2:], [b])   # a request alone: its own ids, no mask needed
    torch.testing.assert_close(alone[0, [60, 95]], mixed[2, [60, 95]], rtol=1e-5, atol=1e-5)
    assert torch.all(alone[0, [50, 70]] == -torch.inf)
    # the rows of a proposal's later draft steps, with the ids of its every request: masked all the same
    later = draft_logits(model, hidden[2:], [b], own_ids([a, None, b]))
    # masked exactly where alone is; the values close, not bit-equal: later's rows past the cut come from a matrix
    # of other ids (50 too), a product of another shape, whose summation order oneDNN picks per shape and CPU
    visible = torch.isfinite(alone)
    assert torch.equal(torch.isfinite(later), visible)
    torch.testing.assert_close(later[visible], alone[visible], rtol=1e-5, atol=1e-5)


def test_draft_vocabulary_auto_cuts_large_vocabularies_only(tiny_pair, gguf_path):
    # "auto" (the default) cuts a vocabulary of more than 65536 tokens to its first 32768; the tiny pair's 96 stay
    from kvserve.spec_decode.config import auto_draft_vocab
    assert [auto_draft_vocab(n) for n in (96, 65536, 65537, 151936)] == [None, None, 32768, 32768]
    target, draft = tiny_pair
    llm = make_llm({"model": draft, "num_speculative_tokens": 2}, model=target, tokenizer=gguf_path)
    assert llm.llm_engine.spec_config.draft_vocab_size == "auto"
    assert llm.llm_engine.runner.draft_model.cut_lm_head is None


def two_sample_chi_square(a: list[int], b: list[int]) -> tuple[float, float]:
    """(statistic, its 99.9% quantile) for 'a and b, as many draws each, come from one distribution'; bins of
    under 10 draws merged."""
    assert len(a) == len(b)
    ca, cb = np.bincount(a, minlength=96), np.bincount(b, minlength=96)
    small = ca + cb < 10
    ca, cb = np.append(ca[~small], ca[small].sum()), np.append(cb[~small], cb[small].sum())
    keep = ca + cb > 0
    ca, cb = ca[keep], cb[keep]
    dof = len(ca) - 1
    quantile = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3   # Wilson-Hilferty
    return float(((ca - cb) ** 2 / (ca + cb)).sum()), quantile


@pytest.mark.parametrize("vocab", [None, 48], ids=["whole", "cut"])
def test_drafts_drawn_from_the_draft_distribution_keep_the_targets(tmp_path, gguf_path, vocab):
    # random requests without a seed draw their drafts from the draft's q (temperature, top-p and a penalty
    # applied) and keep each with probability min(1, p/q): the tokens after the first, which verifications emit,
    # are distributed as without speculation (two-sample chi-square at each of positions 1 to 3). Weights of a
    # larger scale than tiny_pair's give distributions far from uniform, where a wrong q shows. With a cut
    # vocabulary q is zero past the cut for requests that draft from it, in batches with whole ones.
    save_tiny_model("qwen2", tmp_path / "target", num_hidden_layers=3, vocab_size=96, initializer_range=0.25)
    save_first_layer_draft(tmp_path / "target", tmp_path / "draft")
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    params = SamplingParams(temperature=0.5, top_p=0.95, presence_penalty=0.5, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 33, 8, 61]}] * 3000
    off = make_llm(model=target, tokenizer=gguf_path)
    llm = make_llm({"model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None,
                    "draft_vocab_size": vocab}, model=target, tokenizer=gguf_path)
    runner, drawn = llm.llm_engine.runner, []
    propose = runner.propose_drafts

    def recording(reqs, max_drafts):
        drafts = propose(reqs, max_drafts)
        drawn.extend(r.spec_draft_probs is not None for r, d in zip(reqs, drafts) if d)
        return drafts
    runner.propose_drafts = recording
    got = [t[0] for t in tokens(llm.generate(prompts, params, use_tqdm=False))]
    want = [t[0] for t in tokens(off.generate(prompts, params, use_tqdm=False))]
    assert drawn and all(drawn)
    stats = llm.llm_engine.scheduler.spec_stats
    assert 0.05 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.9 * stats.num_draft_tokens
    for pos in range(1, 4):
        statistic, quantile = two_sample_chi_square([t[pos] for t in got], [t[pos] for t in want])
        assert statistic < quantile, (pos, statistic, quantile)


def test_the_memory_profile_samples_the_largest_step_with_drawn_drafts(tiny_pair, gguf_path, monkeypatch):
    # the GPU's KV budget is what a profiled step leaves: it samples max_num_seqs * (k + 1) rows (fewer if the
    # token budget is smaller, or if fewer requests may draft) and verifies drafts drawn from q on every row but
    # each sequence's bonus row
    from kvserve.sample import sampler
    target, draft = tiny_pair
    llm = make_llm({"model": draft, "num_speculative_tokens": 3}, model=target, tokenizer=gguf_path, max_num_seqs=4)
    verified, verify = [], sampler.verify_sampled_drafts

    def recording(probs, u, meta):
        verified.append(meta.sampled_drafts.rows.tolist())
        return verify(probs, u, meta)
    monkeypatch.setattr(sampler, "verify_sampled_drafts", recording)
    engine = llm.llm_engine
    assert engine.runner.profile_step(engine.config, 64) == 16
    assert engine.runner.profile_step(engine.config, 10) == 10
    # drafts only while at most disable_by_batch_size requests run: 2 of them with 4 rows, or 4 with one
    spec = dataclasses.replace(engine.config.speculative_config, disable_by_batch_size=2)
    assert engine.runner.profile_step(dataclasses.replace(engine.config, speculative_config=spec), 64) == 8
    assert verified == [[r for r in range(n) if r % 4 != 3] for n in (16, 10, 8)]
    assert llm.generate(tiny_prompts(1), GREEDY, use_tqdm=False)[0].outputs[0].token_ids   # serving goes on


def test_draft_model_must_share_the_vocabulary_and_be_smaller(tiny_pair, gguf_path, tmp_path):
    target, draft = tiny_pair
    save_tiny_model("qwen2", tmp_path / "other_vocab", num_hidden_layers=1, vocab_size=128)
    with pytest.raises(InvalidRequestError, match="vocabulary has 128 tokens, the target's 96"):
        make_llm({"model": str(tmp_path / "other_vocab"), "num_speculative_tokens": 2}, model=target,
                 tokenizer=gguf_path)
    with pytest.raises(InvalidRequestError, match="is not smaller than the target"):
        make_llm({"model": target, "num_speculative_tokens": 2}, model=draft, tokenizer=gguf_path)
    with pytest.raises(InvalidRequestError, match="could not be loaded"):
        make_llm({"model": str(tmp_path / "missing"), "num_speculative_tokens": 2}, model=target,
                 tokenizer=gguf_path)


class RowCounter:
    """A model that counts the rows it runs; every other attribute is the model's own."""

    def __init__(self, model):
        self.model, self.num_rows = model, 0

    def __call__(self, input_ids, positions, meta):
        self.num_rows += input_ids.numel()
        return self.model(input_ids, positions, meta)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_the_draft_skips_what_its_proposal_wrote_and_keeps_a_right_kv(tmp_path, gguf_path):
    """The draft is the target's first layer, so at every computed position its KV must equal the target's first
    layer's, through accepted and rejected drafts alike (a row the draft skipped that its proposal did not write
    would not); verification steps run the draft on no row (the last draft of a verification that accepted all k
    rides with the next proposal's first draft forward)."""
    from kvserve.attention import attention_layers
    target = save_tiny_model("qwen2", tmp_path / "target", num_hidden_layers=2, vocab_size=96)
    with torch.no_grad():   # a faint second layer: most drafts are accepted, some are not
        for linear in (target.model.layers[1].self_attn.o_proj, target.model.layers[1].mlp.down_proj):
            linear.weight.mul_(0.05)
    target.save_pretrained(tmp_path / "target")
    save_first_layer_draft(tmp_path / "target", tmp_path / "draft")
    spec = {"model": str(tmp_path / "draft"), "num_speculative_tokens": 4, "disable_by_batch_size": None}
    engine = make_llm(spec, model=str(tmp_path / "target"), tokenizer=gguf_path).llm_engine
    runner = engine.runner
    target_kv, draft_kv = attention_layers(runner.model)[0], attention_layers(runner.draft_model)[0]
    runner.model, runner.draft_model = RowCounter(runner.model), RowCounter(runner.draft_model)
    propose, proposal_rows = runner.propose_drafts, []

    def counted_propose(reqs, max_drafts):
        before = runner.draft_model.num_rows
        out = propose(reqs, max_drafts)
        proposal_rows.append(runner.draft_model.num_rows - before)
        return out

    runner.propose_drafts = counted_propose
    prompts = tiny_prompts(3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    bs = engine.block_size

    def check_draft_kv():
        for i in range(len(prompts)):
            req = engine.scheduler.requests[str(i)]
            pos = torch.arange(req.num_computed_tokens)
            slots = torch.tensor(engine.kv.get_block_ids(str(i)))[pos // bs] * bs + pos % bs
            for t, d in ((target_kv.k_cache, draft_kv.k_cache), (target_kv.v_cache, draft_kv.v_cache)):
                torch.testing.assert_close(d.flatten(0, 1)[slots], t.flatten(0, 1)[slots], atol=1e-5, rtol=1e-5)

    for _ in range(8):
        engine.step()
    check_draft_kv()
    stats = copy.deepcopy(engine.scheduler.spec_stats)
    draft_rows, target_rows = runner.draft_model.num_rows, runner.model.num_rows
    # proposals off: the next step verifies the last ones; a request that accepted all its drafts lacks the last
    # one's draft KV, which the decode after writes with its own token
    engine.spec_config.disable_by_batch_size = 0
    engine.step()
    reqs = [engine.scheduler.requests[str(i)] for i in range(len(prompts))]
    assert any(req.draft_kv_end < req.num_computed_tokens for req in reqs)
    # a block whose draft KV is not all written yet is not registered in the prefix cache
    assert engine.kv.enable_caching
    assert all(engine.kv.num_cached_blocks.get(req.request_id, 0) * bs <= req.draft_kv_end for req in reqs)
    for _ in range(2):
        engine.step()
    check_draft_kv()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens   # both paths ran
    verify_rows = draft_rows - sum(proposal_rows)
    prompt_rows = sum(len(p["prompt_token_ids"]) for p in prompts)
    assert verify_rows == prompt_rows and stats.num_drafts < (target_rows - prompt_rows) / 3
    # each proposal's draft forwards: k rows per request, and one more after each verification that accepted all
    all_accepted = stats.num_accepted_per_pos[3]
    assert all_accepted > 0 and sum(proposal_rows) == 4 * len(prompts) * len(proposal_rows) + all_accepted
