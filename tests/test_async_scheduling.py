"""Async scheduling (kvserve/worker/step_pipeline.py): each step is scheduled and launched before the last one's
tokens are back, its placeholders read on the device. Outputs equal the synchronous engine's, request for request,
through chunked prefill, prefix hits, stop strings, seeded sampling with logprobs, n > 1, penalties (which wait
for their token), aborts and a failed step; the launch reads nothing back from the device."""
from __future__ import annotations

import logging

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.entrypoints.cli import build_parser, engine_kwargs
from kvserve.errors import InvalidRequestError, RequestFailedError
from model_utils import FailingForward

SYSTEM = "You are a helpful assistant who answers in one short sentence. "
PROMPTS = [SYSTEM + "What is the capital of France?", SYSTEM + "Name a color.", "Write a haiku about the sea.",
           "Count: 1, 2, 3,", "Tell me a joke about cats.", "Hello!", "Explain gravity in one sentence."]


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=24, stop=["."]),
            SamplingParams(temperature=0, max_tokens=3),
            SamplingParams(temperature=0.8, seed=5, max_tokens=24, logprobs=2),
            SamplingParams(temperature=0, max_tokens=30, min_tokens=12, ignore_eos=False),
            SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.6, repetition_penalty=1.2),
            SamplingParams(temperature=0.7, seed=1, max_tokens=16, n=2),
            SamplingParams(temperature=0, max_tokens=40)]


def completions(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def count_fill_ins(llm) -> list[int]:
    """Counts the steps whose inputs took tokens still on the device."""
    runner, calls = llm.llm_engine.runner, [0]
    fill = runner._fill_in

    def counted(ids, fixup):
        calls[0] += 1
        return fill(ids, fixup)
    runner._fill_in = counted
    return calls


@pytest.fixture(scope="module")
def engines():
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, seed=3)
    return LLM(async_scheduling=False, **kw), LLM(async_scheduling=True, **kw)


def test_mixed_batch_equals_synchronous(engines):
    sync, overlapped = engines
    assert not sync.llm_engine.async_scheduling and overlapped.llm_engine.async_scheduling
    calls = count_fill_ins(overlapped)
    want = sync.generate(PROMPTS, mixed_params(), use_tqdm=False)
    got = overlapped.generate(PROMPTS, mixed_params(), use_tqdm=False)
    assert completions(got) == completions(want)
    for a, b in zip(got[2].outputs[0].logprobs, want[2].outputs[0].logprobs):
        assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert calls[0] > 0   # decodes launched behind the step in flight (how many depends on the outputs: below)
    engine = overlapped.llm_engine
    assert engine._pending is None and engine.kv.num_free_blocks == sync.llm_engine.kv.num_free_blocks


def test_every_decode_step_is_launched_behind_the_one_in_flight(engines):
    """A request that needs none of its tokens on the host (greedy, no penalties, lengths fixed by max_tokens) has
    each decode step after its first launched while the token before is still in flight: 15 of its 16 tokens
    (the first comes from its prefill), whatever this CPU's kernels make of the logits."""
    overlapped = engines[1]
    calls = count_fill_ins(overlapped)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = overlapped.generate(PROMPTS[:1], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 16 and calls[0] == 15
    calls = count_fill_ins(overlapped)
    assert completions(overlapped.generate(PROMPTS[:3], params, use_tqdm=False)) == completions(
        engines[0].generate(PROMPTS[:3], params, use_tqdm=False)) and calls[0] >= 15


def test_prefix_hits_and_a_second_round(engines):
    """The same prompts again: their blocks, hashed while steps were in flight, are hit and give the same tokens."""
    sync, overlapped = engines
    params = SamplingParams(temperature=0, max_tokens=12)
    want = completions(sync.generate(PROMPTS, params, use_tqdm=False))
    hits = overlapped.llm_engine.scheduler.prefix_cache_hits
    assert completions(overlapped.generate(PROMPTS, params, use_tqdm=False)) == want
    assert overlapped.llm_engine.scheduler.prefix_cache_hits > hits


def test_abort_while_its_token_is_in_flight(engines):
    sync, overlapped = engines
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = completions(sync.generate(PROMPTS[:3], params, use_tqdm=False))
    engine = overlapped.llm_engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"abort-{i}", p, params)
    for _ in range(6):
        engine.step()
    assert engine._pending is not None and "abort-1" in engine._pending.index
    engine.abort_request("abort-1")
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sorted(done) == ["abort-0", "abort-2"]
    assert completions([done["abort-0"], done["abort-2"]]) == [want[0], want[2]]
    engine.step()   # nothing left in flight
    assert engine._pending is None and engine.kv.num_free_blocks == sync.llm_engine.kv.num_free_blocks


def test_a_failed_launch_fails_its_requests_only(engines):
    """A step that raises as it launches fails the requests it ran (one of them with its last token in flight),
    as without async scheduling; the step in flight is still merged and the engine serves on."""
    sync, overlapped = engines
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = completions(sync.generate(PROMPTS[:2], params, use_tqdm=False))
    engine = overlapped.llm_engine
    marker = engine.tokenizer.encode("a prompt whose step fails")
    runner = engine.runner
    engine.runner = failing = FailingForward(runner, marker)
    try:
        engine.add_request("ok-0", PROMPTS[0], params)
        for _ in range(3):
            engine.step()
        engine.add_request("bad", {"prompt_token_ids": marker}, params)
        engine.step()   # launches ok-0's decode and bad's prompt: raises
        engine.add_request("ok-1", PROMPTS[1], params)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        failed = engine.take_failed_requests()
    finally:
        engine.runner = runner
    assert failing.failed and sorted(failed) == ["bad", "ok-0"]
    assert all(isinstance(e, RequestFailedError) for e in failed.values())
    assert list(done) == ["ok-1"] and completions([done["ok-1"]]) == [want[1]]
    assert engine._pending is None and engine.kv.num_free_blocks == sync.llm_engine.kv.num_free_blocks
    assert completions(overlapped.generate(PROMPTS[:2], params, use_tqdm=False)) == want


def test_the_launch_reads_nothing_back_from_the_device(monkeypatch):
    """What would wait for the device on a GPU (.tolist(), .item()) stays out of the launch: the host can go on
    while the step runs. finish_step() reads the tokens. A dense model, as on a GPU (the CPU's kernels for a
    GGUF's quantized embedding check the ids on the host)."""
    overlapped = LLM(async_scheduling=True, quantization="none", max_num_seqs=2, num_kv_blocks=32,
                     max_model_len=512)
    runner = overlapped.llm_engine.runner
    launch = runner.launch
    in_launch = [False]

    def guarded(*args):
        in_launch[0] = True
        try:
            return launch(*args)
        finally:
            in_launch[0] = False

    def refuse(name):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            assert not in_launch[0], f"Tensor.{name} in the launch"
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, method)
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "numpy"):
        refuse(name)
    monkeypatch.setattr(runner, "launch", guarded)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=2, max_tokens=12, ignore_eos=True, logprobs=3, top_p=0.9,
                             top_k=20)]
    outs = overlapped.generate(PROMPTS[:2], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


def test_the_choice_is_logged_and_checked(caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(max_num_seqs=2, num_kv_blocks=16)
    assert not llm.llm_engine.async_scheduling
    assert any("async scheduling off (the CPU computes" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidRequestError, match="async_scheduling does not run with speculative decoding"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    args = build_parser().parse_args(["serve", "--async-scheduling"])
    assert engine_kwargs(args)["async_scheduling"] is True
    assert engine_kwargs(build_parser().parse_args(["serve", "--no-async-scheduling"]))["async_scheduling"] is False
