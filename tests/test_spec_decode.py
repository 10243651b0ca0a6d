"""Speculative decoding end to end with the n-gram and suffix proposers: every method's output equals the output
without speculation (greedy, and seeded sampling too), under batching, chunked prefill, preemption and prefix
caching; stops, logprobs and n > 1 across accepted tokens; bad configurations refused at start; the batch-size
switch; the metrics. The draft-model method: tests/test_spec_draft_model.py."""
import logging

import pytest

from kvserve import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.metrics import EngineMetrics, StatLogger
from kvserve.spec_decode.config import SpeculativeConfig

from spec_utils import GREEDY, STRESS, make_llm, tokens

CODE = ("def area(width, height):\n    result = width * height\n    return result\n\n"
        "def perimeter(width, height):\n    result = 2 * (width + height)\n    return result\n")
PROMPTS = [
    f"Rewrite this code, naming the result `value` instead of `result`:\n{CODE}\n",
    f"Repeat the following code exactly:\n{CODE}\n",
    "The capital of France is",
    "1, 2, 3, 4, 5,",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}


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
    ({"model": "x", "num_speculative_tokens": 3, "draft_vocab_size": "all"}, "integer >= 1"),
    ({"model": "x", "num_speculative_tokens": 3, "draft_vocab_size": True}, "integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "adaptive_draft_length": "yes"}, "adaptive_draft_length"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_head_quantization": "q4_0"}, "draft_model only"),
    ({"model": "x", "num_speculative_tokens": 3, "draft_head_quantization": "q8"}, "draft_head_quantization must"),
    ({"method": "suffix", "num_speculative_tokens": 3, "draft_quantization": "q4_0"}, "draft_model only"),
    ({"model": "x", "num_speculative_tokens": 3, "draft_quantization": True}, "draft_quantization must"),
    ({"method": "ngram", "num_speculative_tokens": 3, "max_spec_factor": 0}, "max_spec_factor"),
    ({"method": "suffix", "num_speculative_tokens": 3, "max_spec_factor": "2"}, "max_spec_factor"),
    ({"method": "suffix", "num_speculative_tokens": 3, "max_spec_factor": True}, "max_spec_factor"),
    ({"method": "ngram", "num_speculative_tokens": 3, "max_spec_factor": 10 ** 400}, "max_spec_factor"),
])
def test_bad_configs_are_refused_at_start(spec, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        make_llm(spec)
    assert e.value.param == "speculative_config"


def test_method_is_inferred_from_the_draft_model():
    assert SpeculativeConfig.parse({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 2}').method == "suffix"


def test_draft_length_defaults_by_method():
    # the history rule (adaptive_draft_length) defaults on for a draft model only; n-gram and suffix drafts are
    # sized by their match (max_spec_factor 1), and either may be set
    parse = SpeculativeConfig.parse
    assert parse({"model": "x", "num_speculative_tokens": 2}).adaptive_draft_length is True
    for method in ("ngram", "suffix"):
        config = parse({"method": method, "num_speculative_tokens": 2})
        assert config.adaptive_draft_length is False and config.max_spec_factor == 1.0
    config = parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive_draft_length": True,
                    "max_spec_factor": None})
    assert config.adaptive_draft_length is True and config.max_spec_factor is None
    # a config built directly gets its method's default when the engine parses it
    assert parse(SpeculativeConfig("draft_model", 2, model="x")).adaptive_draft_length is True


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
