"""The server on the real engine, in-process: overload (503), internal failures (500), n choices
finishing at different steps, shutdown. Faults are injected around the real LLMEngine, nothing else
is replaced: a gate holds step(), a marker prompt makes add_request or one step raise."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest
import torch

from kvserve import kernels
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.quantization import FORMAT_IDS, QuantizedTensor, QuantizedWeight, quantized_matmul
from model_utils import FailingForward


class FaultyEngine:
    """The real LLMEngine with injected faults; every other attribute is the engine's own."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.crash_ids: set[str] = set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt, params, *args, **kwargs):
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if text == "boom":
            raise RuntimeError("tokenizer exploded")
        if text == "crash":
            self.crash_ids.add(request_id)
        return self._engine.add_request(request_id, prompt, params, *args, **kwargs)

    def step(self):
        self.gate.wait()
        if self.crash_ids & set(self._engine.processor.parents):
            self.crash_ids.clear()
            raise RuntimeError("CUDA error: device-side assert")
        return self._engine.step()


@pytest.fixture(scope="module")
def real_engine():
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=256, num_kv_blocks=64))


def run_in_process(real_engine, scenario, max_waiting_requests: int | None = None):
    """Run `scenario(http, faulty, engine)` against the app, in-process."""
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.entrypoints.openai.api_server import ServerSettings, build_app

    async def main():
        faulty = FaultyEngine(real_engine)
        engine = AsyncLLMEngine(faulty, max_waiting_requests)
        app = build_app(engine, ServerSettings(served_model_names=["m"]))
        engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m") as http:
                await scenario(http, faulty, engine)
        finally:
            faulty.gate.set()
            await engine.stop()
        assert not real_engine.has_unfinished_requests()
        assert real_engine.kv.num_free_blocks == real_engine.num_kv_blocks
    asyncio.run(main())


def test_full_waiting_queue_gets_503_with_retry_after(real_engine):
    async def scenario(http, faulty, engine):
        faulty.gate.clear()   # the engine thread blocks in its next step, so later adds stay queued
        body = {"prompt": "hi", "max_tokens": 2}
        first = asyncio.create_task(http.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(http.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded" and "--max-waiting-requests" in r.text
        faulty.gate.set()
        assert [(await t).status_code for t in (first, second)] == [200, 200]
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    run_in_process(real_engine, scenario, max_waiting_requests=2)


def test_internal_failure_is_a_500_for_that_request_only(real_engine):
    async def scenario(http, faulty, engine):
        ok = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
        results = await asyncio.gather(http.post("/v1/completions", json={"prompt": "boom"}),
                                       http.post("/v1/completions", json=ok))
        assert [r.status_code for r in results] == [500, 200]
        err = results[0].json()["error"]
        assert err["type"] == "server_error" and "tokenizer exploded" in err["message"]
        # a failing step fails the requests in it; the engine keeps serving the next ones
        crashed = await http.post("/v1/completions", json={"prompt": "crash"})
        assert crashed.status_code == 500 and "step failed" in crashed.json()["error"]["message"]
        again = await http.post("/v1/completions", json=ok)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == results[1].json()["choices"][0]["text"]
        assert (await http.get("/health")).status_code == 200
    run_in_process(real_engine, scenario)


def test_a_failing_forward_fails_its_requests_and_the_queue_goes_on():
    """One sequence at a time: the failing step's request gets a 500, the one waiting behind it its answer."""
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=1))
    marker = engine.tokenizer.encode("crash in the forward")
    engine.runner = FailingForward(engine.runner, marker)

    async def scenario(http, faulty, async_engine):
        faulty.gate.clear()
        doomed = asyncio.create_task(http.post("/v1/completions", json={"prompt": "crash in the forward"}))
        await asyncio.sleep(0.3)
        body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
        waiting = asyncio.create_task(http.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)
        faulty.gate.set()
        r = await doomed
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        ok = await waiting
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert engine.runner.failed
    run_in_process(engine, scenario)


def test_a_prompt_larger_than_the_kv_pool_is_400_at_once_and_stalls_nothing():
    """The issue's case: a pool far below max_model_len, a long chat message and no max_tokens."""
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=2048, num_kv_blocks=22, block_size=16))

    async def scenario(http, faulty, async_engine):
        long_chat = {"messages": [{"role": "user", "content": "word " * 400}]}
        r = await asyncio.wait_for(http.post("/v1/chat/completions", json=long_chat), timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert "whole KV cache has 22 blocks (352 tokens)" in err["message"] and "--kv-cache-memory" in err["message"]
        ok = await asyncio.wait_for(http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}), timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 4
    run_in_process(engine, scenario)


def test_n_choices_that_finish_at_different_steps(real_engine):
    async def scenario(http, faulty, engine):
        for path, body in (("/v1/completions", {"prompt": "Write one word:"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say a word."}]})):
            body = {**body, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 1, "stop": [" "]}
            whole = (await http.post(path, json=body)).json()
            texts = [c.get("text", c.get("message", {}).get("content")) for c in whole["choices"]]
            events = (await http.post(path, json={**body, "stream": True})).text.strip().split("\n\n")
            assert events[-1] == "data: [DONE]"
            choices = [c for e in events[:-1] for c in json.loads(e.removeprefix("data: "))["choices"]]
            finishes = [c["index"] for c in choices if c.get("finish_reason")]
            assert sorted(finishes) == [0, 1, 2]                  # each choice finishes exactly once
            streamed = ["".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                                for c in choices if c["index"] == i) for i in range(3)]
            assert streamed == texts
            lengths = [len(real_engine.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
            assert len(set(lengths)) > 1, "the seed should give choices of different lengths"
    run_in_process(real_engine, scenario)


def test_shutdown_tells_unfinished_requests_why(real_engine):
    async def scenario(http, faulty, engine):
        faulty.gate.clear()
        whole = asyncio.create_task(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}))
        streamed = asyncio.create_task(http.post("/v1/completions", json={"prompt": "hi", "stream": True}))
        await asyncio.sleep(0.3)
        engine.begin_shutdown(grace_s=0.2)
        late = await http.post("/v1/completions", json={"prompt": "hi"})
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
        r = await whole
        assert r.status_code == 503 and "shut down before this request finished" in r.json()["error"]["message"]
        events = (await streamed).text.strip().split("\n\n")
        assert events[-1] == "data: [DONE]" and "server_shutting_down" in events[-2]
    run_in_process(real_engine, scenario)


def test_stats_log_line(caplog):
    from kvserve.core.scheduler_stats import SchedulerStats
    from kvserve.metrics import EngineMetrics, StatLogger
    from kvserve.outputs import CompletionOutput, RequestOutput
    metrics = EngineMetrics("m")
    logger = StatLogger(metrics, interval_s=10.0)
    out = RequestOutput("r", "p", [1, 2, 3, 4], None, [CompletionOutput(0, "ab", [5, 6], None, None)], False, 0,
                        {"arrival_time": 0.0})
    metrics.record_outputs([out], now=1.0)
    stats = SchedulerStats(num_running=1, num_waiting=2, kv_cache_usage=0.25, num_preemptions=0,
                           prefix_cache_queries=4, prefix_cache_hits=1)
    metrics.update_scheduler(stats)
    caplog.set_level("INFO", logger="kvserve.stats")
    assert not logger.maybe_log(stats, now=logger._last_time + 5)   # not 10 s yet
    assert logger.maybe_log(stats, now=logger._last_time + 10)
    line = caplog.records[-1]
    assert "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%" in line.message
    assert line.generation_throughput == 0.2 and line.prompt_throughput == 0.4
    assert not logger.maybe_log(SchedulerStats(0, 0, 0.0, 0, 4, 1), now=logger._last_time + 10)   # idle: quiet


def test_a_grammar_past_its_compile_time_limit_is_a_400_and_stalls_nothing(real_engine):
    """The server waits for a request's grammar before queuing it, at most grammar_compile_timeout_s; past that the
    request is a 400 (streamed too: nothing has been sent yet), and the engine serves the others meanwhile."""
    manager = real_engine.structured_output

    async def scenario(http, faulty, engine):
        manager.compile_timeout_s = 1e-6   # shorter than any compilation
        slow = {"prompt": "hi", "max_tokens": 3, "structured_outputs": {"regex": "[a-z]{2,5} never cached"}}
        ok = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
        results = await asyncio.gather(http.post("/v1/completions", json=slow),
                                       http.post("/v1/completions", json={**slow, "stream": True,
                                                                          "structured_outputs": {"regex": "[0-9]+x"}}),
                                       http.post("/v1/completions", json=ok))
        assert [r.status_code for r in results] == [400, 400, 200]
        for r in results[:2]:
            err = r.json()["error"]
            assert err["param"] == "structured_outputs" and "longer than" in err["message"]

    try:
        run_in_process(real_engine, scenario)
    finally:
        manager.compile_timeout_s = real_engine.config.grammar_compile_timeout_s


def test_a_request_id_taken_while_a_grammar_compiles_is_refused(real_engine):
    """The id is reserved before the grammar's compilation is awaited: a second request with the same id is a 400,
    and the first one still gets its answer."""
    async def scenario(http, faulty, engine):
        body = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "request_id": "same",
                "structured_outputs": {"regex": "[a-z]{3} taken"}}
        first = asyncio.create_task(http.post("/v1/completions", json=body))
        second = asyncio.create_task(http.post("/v1/completions", json={**body, "structured_outputs": None}))
        r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 60)
        assert r1.status_code == 200 and r1.json()["choices"][0]["text"]
        assert r2.status_code == 400 and r2.json()["error"]["param"] == "request_id"
    run_in_process(real_engine, scenario)


def _tids() -> set[str]:
    return set(os.listdir(f"/proc/{os.getpid()}/task"))


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_main_threads_openmp_workers_end_when_the_engine_thread_starts(real_engine, monkeypatch):
    """libgomp shortens its spin waits once it keeps more workers than there are CPUs, and every parallel region of
    the engine thread then puts its workers to sleep and wakes them through the kernel: the workers the main thread
    started (loading the model) end when the engine thread starts."""
    if kernels.load() is None or torch.get_num_threads() < 2:
        pytest.skip("no C++ kernels, or one thread")
    weight = QuantizedWeight([QuantizedTensor(FORMAT_IDS["Q8_0"], torch.zeros(256, 8 * 34, dtype=torch.uint8), 256)])
    kernels.release_openmp_workers()
    before = _tids()
    quantized_matmul(torch.randn(4, 256), weight)   # a parallel region on this thread: its workers start
    workers = _tids() - before
    assert len(workers) == torch.get_num_threads() - 1, workers
    kernels.release_openmp_workers()
    assert _wait_until(lambda: not workers & _tids()), "the workers did not end"
    released = []
    monkeypatch.setattr(kernels, "release_openmp_workers",
                        lambda: released.append(threading.current_thread() is threading.main_thread()))

    async def scenario(http, faulty, engine):
        assert (await http.get("/health")).status_code == 200

    run_in_process(real_engine, scenario)
    assert released == [True]
