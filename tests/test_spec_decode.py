"""Speculative decoding end to end: every method's output equals the output without speculation (greedy, and seeded
sampling too), under batching, chunked prefill, preemption and prefix caching; stops, logprobs and n > 1 across
accepted tokens; bad configurations refused at start; the batch-size switch; the metrics."""
import copy
import dataclasses
import logging

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.metrics import EngineMetrics, StatLogger
from kvserve.spec_decode.config import SpeculativeConfig

from model_utils import save_tiny_model

CODE = ("def area(width, height):\n    result = width * height\n    return result\n\n"
        "def perimeter(width, height):\n    result = 2 * (width + height)\n    return result\n")
PROMPTS = [
    f"Rewrite this code, naming the result `value` instead of `result`:\n{CODE}\n",
    f"Repeat the following code exactly:\n{CODE}\n",
    "The capital of France is",
    "1, 2, 3, 4, 5,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}
# small steps and a small pool: budgets cut drafts, prompts run in chunks, requests are preempted; every prompt
# runs twice (the second time from the prefix cache). The reference's block size: the attention kernels sum each
# KV block's share in turn, so another block size rounds differently and may flip a near-tie
STRESS = dict(max_num_batched_tokens=24, num_kv_blocks=12, block_size=16, max_num_seqs=4)


def make_llm(spec=None, **kwargs):
    return LLM(dtype="float32", speculative_config=spec, **kwargs)


def tokens(outputs):
    return [[o.token_ids for o in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def off():
    return make_llm()


@pytest.fixture(scope="module")
def reference(off):
    return tokens(off.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module", params=list(METHODS))
def spec_llm(request):
    return make_llm(METHODS[request.param])


def test_greedy_output_equals_no_speculation(spec_llm, reference):
    stats = spec_llm.llm_engine.scheduler.spec_stats
    before = stats.copy()
    assert tokens(spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    rejected = stats.num_draft_tokens - before.num_draft_tokens - accepted
    assert accepted > 10 and rejected > 0   # both the accepted and the rejected path ran


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_under_chunking_preemption_and_prefix_caching(method, reference):
    llm = make_llm(METHODS[method], **STRESS)
    sched = llm.llm_engine.scheduler
    out = tokens(llm.generate(PROMPTS + PROMPTS, GREEDY, use_tqdm=False))
    assert out == reference + reference
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0 and sched.spec_stats.num_accepted_tokens > 0
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.num_kv_blocks   # nothing leaked


SAMPLED = [SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True),
           SamplingParams(temperature=1.0, top_k=20, seed=8, frequency_penalty=0.5, presence_penalty=0.3,
                          repetition_penalty=1.2, max_tokens=32, ignore_eos=True),
           SamplingParams(temperature=0.7, min_p=0.05, seed=9, n=2, logit_bias={198: 2.0}, max_tokens=32,
                          ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=32, min_tokens=24, stop_token_ids=[198, 28])]


def test_seeded_sampling_equals_no_speculation(off, spec_llm):
    """The target samples every verified position with the draw it would use without speculation: seeded requests
    give the very same tokens (penalties, logit_bias and min_tokens see the accepted drafts as output)."""
    prompts = PROMPTS[:2] * 2
    params = SAMPLED
    assert tokens(spec_llm.generate(prompts, params, use_tqdm=False)) == \
        tokens(off.generate(prompts, params, use_tqdm=False))


STOPS = [SamplingParams(temperature=0, max_tokens=3),
         SamplingParams(temperature=0, max_tokens=40, stop=["# Output"]),
         SamplingParams(temperature=0, max_tokens=40, stop=["perimeter"], include_stop_str_in_output=True),
         SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[216], logprobs=2),
         SamplingParams(temperature=0, max_tokens=40, logprobs=3)]


def test_stops_and_logprobs_across_accepted_tokens(off, spec_llm):
    prompts = [PROMPTS[0]] * len(STOPS)
    want = off.generate(prompts, STOPS, use_tqdm=False)
    got = spec_llm.generate(prompts, STOPS, use_tqdm=False)
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (w.token_ids, w.text, w.finish_reason, w.stop_reason)
        if w.logprobs is not None:   # none recorded for tokens dropped after a stop
            assert len(g.logprobs) == len(g.token_ids)
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-2)
    assert [o.outputs[0].finish_reason for o in got] == ["length", "stop", "stop", "stop", "length"]
    w, g = want[-1].outputs[0], got[-1].outputs[0]
    assert len(g.logprobs) == len(g.token_ids) == 40
    for lw, lg, token in zip(w.logprobs, g.logprobs, g.token_ids):
        assert lw.keys() == lg.keys() and token in lg
        assert all(abs(lw[t].logprob - lg[t].logprob) < 1e-3 and lw[t].rank == lg[t].rank for t in lw)
    assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-2)


def test_streamed_deltas_carry_all_accepted_tokens(spec_llm, reference):
    from kvserve.sampling_params import RequestOutputKind
    engine = spec_llm.llm_engine
    engine.add_request("stream", PROMPTS[1], GREEDY.clone(output_kind=RequestOutputKind.DELTA))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [out.outputs[0].token_ids for out in engine.step() if out.outputs]
    assert sum(deltas, []) == reference[1][0]
    assert max(map(len, deltas)) > 1   # several tokens emitted in one step


def test_batch_size_switch_turns_drafts_off():
    llm = make_llm({**NGRAM, "disable_by_batch_size": 2})
    stats = llm.llm_engine.scheduler.spec_stats
    short = GREEDY.clone(max_tokens=8)
    llm.generate(PROMPTS[:3], short, use_tqdm=False)   # three running all along: no drafts
    assert stats.num_drafts == 0
    llm.generate(PROMPTS[:2], short, use_tqdm=False)
    assert stats.num_drafts > 0


@pytest.mark.parametrize("adaptive", [True, False])
def test_adaptive_draft_length_follows_the_accepted_runs(adaptive, reference):
    # adaptive: after a verification that rejected a draft, the next proposal may make as many drafts as were
    # accepted plus one; after one that accepted all, one more than before, up to k. Off: k every time. The output
    # is the same either way
    llm = make_llm({**NGRAM, "adaptive_draft_length": adaptive})
    engine = llm.llm_engine
    proposals, verifications = [], []   # (draft_len, limit, drafts made); (drafts, accepted)
    propose, record = engine.proposer.propose_batch, engine.scheduler.spec_stats.record

    def spy_propose(reqs, max_drafts):
        drafts = propose(reqs, max_drafts)
        if reqs:   # the engine proposes for no one once the request has finished
            proposals.append((reqs[0].draft_len, max_drafts[0], len(drafts[0])))
        return drafts

    def spy_record(num_drafts, accepted):
        verifications.append((num_drafts, accepted))
        record(num_drafts, accepted)

    engine.proposer.propose_batch, engine.scheduler.spec_stats.record = spy_propose, spy_record
    out = llm.generate(PROMPTS[0], GREEDY.clone(max_tokens=64), use_tqdm=False)
    assert out[0].outputs[0].token_ids[:32] == reference[0][0]
    k = NGRAM["num_speculative_tokens"]
    assert any(a < d for d, a in verifications)   # the prompt has rejections to adapt to
    if not adaptive:
        assert all(length is None for length, _, _ in proposals) and max(m for _, m, _ in proposals) == k
        return
    # the proposals that drafted are followed, in order, by the verifications
    assert len(verifications) == sum(made > 0 for _, _, made in proposals)
    expect, verified = k, iter(verifications)
    for length, limit, made in proposals:
        assert length == expect and limit <= length <= k and made <= limit
        if made:
            num_drafts, accepted = next(verified)
            expect = min(k, accepted + 1 if accepted < num_drafts else length + 1)
    assert min(length for length, _, _ in proposals) < k   # it did shorten


@pytest.mark.parametrize("spec, match", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "unknown method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 3}, "needs a method"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs a model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 3, "k": 1}, "unknown speculative_config key"),
    ("{not json", "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_vocab_size": 100}, "draft_model only"),
    ({"model": "x", "num_speculative_tokens": 3, "draft_vocab_size": 0}, "integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "adaptive_draft_length": "yes"}, "adaptive_draft_length"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_head_quantization": "q4_0"}, "draft_model only"),
    ({"model": "x", "num_speculative_tokens": 3, "draft_head_quantization": "q8"}, "draft_head_quantization must"),
])
def test_bad_configs_are_refused_at_start(spec, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        make_llm(spec)
    assert e.value.param == "speculative_config"


def test_method_is_inferred_from_the_draft_model():
    assert SpeculativeConfig.parse({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 2}').method == "suffix"


# ----- a draft model: a random tiny target and a draft made of its first layer -----
def save_first_layer_draft(target_dir, draft_dir) -> None:
    """Save, as a draft model, the saved target's first layer (with its embeddings, final norm and head)."""
    from transformers import AutoModelForCausalLM
    draft = AutoModelForCausalLM.from_pretrained(target_dir)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:1]
    draft.save_pretrained(draft_dir)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    save_tiny_model("qwen2", root / "target", num_hidden_layers=3, vocab_size=96)
    save_first_layer_draft(root / "target", root / "draft")
    return str(root / "target"), str(root / "draft")


def tiny_prompts(n=6):
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 96, (int(8 + 9 * i),), generator=g).tolist()} for i in range(n)]


@pytest.mark.parametrize("config", [{}, STRESS], ids=["batched", "chunked-preempted-cached"])
def test_draft_model_greedy_equals_no_speculation(tiny_pair, gguf_path, config):
    target, draft = tiny_pair
    prompts = tiny_prompts()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = tokens(make_llm(model=target, tokenizer=gguf_path).generate(prompts, params, use_tqdm=False))
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


def test_draft_vocabulary_of_its_first_ids_keeps_the_output(tiny_pair, gguf_path):
    target, draft = tiny_pair
    prompts = tiny_prompts()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = tokens(make_llm(model=target, tokenizer=gguf_path).generate(prompts, params, use_tqdm=False))
    assert any(t >= 48 for req in want for seq in req for t in seq)   # ids the draft cannot propose
    spec = {"model": draft, "num_speculative_tokens": 4, "disable_by_batch_size": None, "draft_vocab_size": 48}
    llm = make_llm(spec, model=target, tokenizer=gguf_path)
    runner, proposed = llm.llm_engine.runner, []
    propose = runner.propose_drafts

    def recording(reqs, max_drafts):
        drafts = propose(reqs, max_drafts)
        proposed.extend(t for d in drafts for t in d)
        return drafts
    runner.propose_drafts = recording
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert proposed and max(proposed) < 48
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    with pytest.raises(InvalidRequestError, match="exceeds the vocabulary"):
        make_llm({**spec, "draft_vocab_size": 97}, model=target, tokenizer=gguf_path)


def tiny_head_config(tmp_path, weights: str, tied: bool):
    """A tiny llama's EngineConfig with its weights as named (float32, bfloat16, Q8_0: a GGUF, int8), and its
    hidden size."""
    from kvserve.config import EngineConfig
    from model_utils import write_tiny_gguf
    hf = save_tiny_model("llama", tmp_path / "hf", tie_word_embeddings=tied)
    if weights == "Q8_0":
        return EngineConfig(model=str(write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype="Q8_0")), device="cpu"), \
            hf.config.hidden_size
    return EngineConfig(model=str(tmp_path / "hf"), device="cpu", tokenizer=str(tmp_path / "hf"),
                        dtype="float32" if weights == "int8" else weights,
                        quantization="int8" if weights == "int8" else "none"), hf.config.hidden_size


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "Q8_0", "int8"])
@pytest.mark.parametrize("tied", [False, True])
def test_restricted_head_gives_the_first_columns_of_the_logits(tmp_path, weights, tied):
    from kvserve.model import load_model
    from kvserve.model.layers import release_unpacked_weights
    config, hidden_size = tiny_head_config(tmp_path, weights, tied)
    full_model, model = load_model(config)[0], load_model(config)[0]
    hidden = torch.randn(5, hidden_size, dtype=model.model.norm.weight.dtype)
    model.restrict_vocab(40)
    for m in (full_model, model):   # as the engine serves them: packed, plain copies released
        m.prepack()
        release_unpacked_weights(m)
    full, part = full_model.compute_logits(hidden), model.compute_logits(hidden)
    cols = 48 if weights == "int8" else 40   # int8 rows come in groups of 16
    assert part.shape == (5, cols)
    if weights in ("Q8_0", "int8"):   # kept quantized: each column by the same kernel row
        assert model.lm_head.quantized.formats() == ["Q8_0" if weights == "Q8_0" else "INT8"]
        assert torch.equal(part, full[:, :cols])
    else:
        torch.testing.assert_close(part, full[:, :cols], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="restrict_vocab"):
        model.restrict_vocab(257)


@pytest.mark.parametrize("weights", ["float32", "Q8_0", "int8"])
@pytest.mark.parametrize("tied", [False, True])
def test_head_requantized_to_q4_0_is_ggmls_q4_0_of_its_rows(tmp_path, weights, tied):
    # quantize_head_q4_0 (draft_head_quantization): the head's blocks are ggml's Q4_0 (gguf-py's quantizer) of the
    # stored head's rows, dequantized, the cut ones after restrict_vocab (int8: 48, its group of 16); a tied
    # model's embedding lookups keep the table as stored
    import gguf
    from kvserve.model import load_model
    config, _ = tiny_head_config(tmp_path, weights, tied)
    model = load_model(config)[0]
    src = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    stored = src.weight.detach().float() if src.quantized is None else src.quantized.dequantize()
    assert model.head_format() == {"float32": None, "Q8_0": "Q8_0", "int8": "INT8"}[weights]
    ids = torch.tensor([3, 17, 200])
    looked_up = model.model.embed_tokens(ids).clone()
    model.restrict_vocab(40)
    model.quantize_head_q4_0()
    assert model.head_format() == "Q4_0"
    rows = 48 if weights == "int8" else 40
    q4 = gguf.GGMLQuantizationType.Q4_0
    want = gguf.quants.dequantize(gguf.quants.quantize(stored[:rows].numpy(), q4), q4)
    assert np.array_equal(model.lm_head.quantized.dequantize().numpy(), want)
    assert torch.equal(model.model.embed_tokens(ids), looked_up)
    model.prepack()
    hidden = torch.randn(5, model.config.hidden_size, dtype=model.model.norm.weight.dtype)
    logits = model.compute_logits(hidden)
    exact = hidden.double() @ torch.from_numpy(want).double().T
    assert logits.shape == (5, rows) and (logits.double() - exact).norm() < 0.02 * exact.norm()


def test_draft_head_in_q4_0_keeps_the_output(tiny_pair, gguf_path, tmp_path):
    # draft_head_quantization: "q4_0" requantizes a dense draft's head, "auto" a Q8_0 GGUF draft's and leaves a
    # dense one's, null keeps the Q8_0 one; the output stays the target's. A hidden size that Q4_0's blocks of 32
    # do not divide is refused at start, and so is "q4_0" without the C++ kernels
    from transformers import AutoModelForCausalLM
    from model_utils import write_tiny_gguf
    target, draft = tiny_pair
    hf_draft = AutoModelForCausalLM.from_pretrained(draft)
    hf_draft.config.head_dim = hf_draft.config.hidden_size // hf_draft.config.num_attention_heads
    q8 = str(write_tiny_gguf(tmp_path / "draft.gguf", hf_draft, arch="qwen2", qtype="Q8_0"))
    prompts, params = tiny_prompts(), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = tokens(make_llm(model=target, tokenizer=gguf_path).generate(prompts, params, use_tqdm=False))
    for path, setting, fmt in [(draft, "q4_0", "Q4_0"), (draft, "auto", None), (q8, "auto", "Q4_0"),
                               (q8, None, "Q8_0")]:
        spec = {"model": path, "num_speculative_tokens": 4, "disable_by_batch_size": None,
                "draft_head_quantization": setting}
        llm = make_llm(spec, model=target, tokenizer=gguf_path)
        assert llm.llm_engine.runner.draft_model.head_format() == fmt
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
        assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    save_tiny_model("qwen2", tmp_path / "narrow", num_hidden_layers=1, vocab_size=96, hidden_size=48)
    with pytest.raises(InvalidRequestError, match="hidden size 48 is not a multiple of 32"):
        make_llm({"model": str(tmp_path / "narrow"), "num_speculative_tokens": 2, "draft_head_quantization": "q4_0"},
                 model=target, tokenizer=gguf_path)
    from kvserve import kernels
    with kernels.variant("none"), pytest.raises(InvalidRequestError, match="needs the CPU and its C\\+\\+ kernels"):
        make_llm({"model": draft, "num_speculative_tokens": 2, "draft_head_quantization": "q4_0"}, model=target,
                 tokenizer=gguf_path)


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


def test_drafts_drawn_from_the_draft_distribution_keep_the_targets(tmp_path, gguf_path):
    # random requests without a seed draw their drafts from the draft's q (temperature, top-p and a penalty
    # applied) and keep each with probability min(1, p/q): the tokens after the first, which verifications emit,
    # are distributed as without speculation (two-sample chi-square at each of positions 1 to 3). Weights of a
    # larger scale than tiny_pair's give distributions far from uniform, where a wrong q shows.
    save_tiny_model("qwen2", tmp_path / "target", num_hidden_layers=3, vocab_size=96, initializer_range=0.25)
    save_first_layer_draft(tmp_path / "target", tmp_path / "draft")
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    params = SamplingParams(temperature=0.5, top_p=0.95, presence_penalty=0.5, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 33, 8, 61]}] * 3000
    off = make_llm(model=target, tokenizer=gguf_path)
    llm = make_llm({"model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None},
                   model=target, tokenizer=gguf_path)
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


# ----- metrics -----
def test_metrics_and_stats_line_report_acceptance(spec_llm, caplog):
    metrics = EngineMetrics("m")
    logger = StatLogger(metrics, interval_s=0.0)
    spec_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    stats = spec_llm.llm_engine.scheduler.stats()
    metrics.update_scheduler(stats)
    text = metrics.render().decode()
    spec = stats.spec_decoding
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(spec.num_drafts)}' in text
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(spec.num_draft_tokens)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(spec.num_accepted_tokens)}' in text
    assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} '
            f'{float(spec.num_accepted_per_pos[0])}') in text
    with caplog.at_level(logging.INFO, logger="kvserve.stats"):
        assert logger.maybe_log(stats)
    rate = 100 * spec.num_accepted_tokens / spec.num_draft_tokens
    assert f"Draft acceptance rate: {rate:.1f}%" in caplog.text
    assert f"Mean acceptance length: {1 + spec.num_accepted_tokens / spec.num_drafts:.2f}" in caplog.text


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
