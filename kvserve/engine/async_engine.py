"""AsyncLLMEngine: the server's engine. One background thread steps the LLMEngine; every request streams its
outputs through its own asyncio queue, so many requests share each step and a slow reader holds up no one.

    event-loop thread                                  engine thread (the only one touching LLMEngine)
    add_request() -> command --+                       +-> run commands: engine.add_request / abort_request
    abort()       -> command --+--> _commands ---------+-> engine.step() -> outputs
    RequestStream.get()  <----- call_soon_threadsafe(_dispatch) <-----------+

Commands run between steps because the engine is not thread-safe. All requests ask for DELTA outputs.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from kvserve import kernels
from kvserve.core.scheduler_stats import SchedulerStats
from kvserve.engine.llm_engine import LLMEngine
from kvserve.errors import EngineDeadError, InvalidRequestError, KVServeError, RequestFailedError
from kvserve.metrics import EngineMetrics, StatLogger
from kvserve.model.loader import use_device
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.structured_output.request import compile_timeout_error

logger = logging.getLogger("kvserve.engine")

_IDLE_WAIT_S = 1.0   # how often an idle engine thread wakes to write the stats log


class EngineOverloadedError(KVServeError):
    """The waiting queue is at --max-waiting-requests; the request was not queued."""


class EngineStoppedError(KVServeError):
    """The engine is shutting down: it takes no new requests, and aborts those it cannot finish."""


class RequestStream:
    """One request's outputs in order; the last is a finished RequestOutput or an exception."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.aborted = False
        self.add_future: asyncio.Future | None = None   # set while the engine thread has not added it yet

    def put(self, item: RequestOutput | BaseException) -> None:
        self.queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        """The next output; raises the error that ended the request, if one did."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


async def stream_outputs(stream: RequestStream, abort: Callable[[str], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs until it finishes; abort(request id) if the consumer stops early."""
    try:
        while True:
            out = await stream.get()
            yield out
            if out.finished:
                return
    finally:
        if not stream.finished:
            abort(stream.request_id)


class AsyncLLMEngine:
    """Serves many concurrent requests from one LLMEngine stepped by a background thread."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 metrics: EngineMetrics | None = None, stats_interval_s: float = 10.0):
        self.engine = engine
        # the frontend tokenizes on the event loop; HF fast tokenizers are not safe to share across threads
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics or EngineMetrics("kvserve")
        self.stat_logger = StatLogger(self.metrics, stats_interval_s)
        if engine.lora is not None:
            self.metrics.enable_lora(engine.config.max_loras, engine.lora.adapter_names)
        self.dead_error: BaseException | None = None
        self.on_dead: list[Callable[[], None]] = []   # called (engine or monitor thread) once the engine is dead
        if engine.executor is not None:   # a tensor-parallel worker that dies kills the engine, also when idle
            engine.executor.on_dead.append(lambda message: self._die(EngineDeadError(message)))
        self._streams: dict[str, RequestStream] = {}
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Event()
        self._engine_ids: set[str] = set()   # engine thread only: requests the engine holds
        self._num_waiting = 0                # written by the engine thread, read by the event loop
        self._num_pending_adds = 0           # event loop only: adds not yet run by the engine thread
        self._accepting = True
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ----- life cycle -----
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will serve requests."""
        self._loop = asyncio.get_running_loop()
        kernels.release_openmp_workers()   # this thread's, from loading the model: they would slow the engine's
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; abort the ones still running after `grace_s`. Safe from a signal handler."""
        if not self._accepting or self._loop is None:
            return
        self._accepting = False
        logger.info("shutting down: finishing %d in-flight request(s), at most %.0f s", len(self._streams), grace_s)
        self._loop.call_soon_threadsafe(self._loop.call_later, grace_s, self.abort_all,
                                        EngineStoppedError("the server shut down before this request finished"))

    async def stop(self) -> None:
        """Abort whatever is left and stop the engine thread."""
        self._accepting = False
        self.abort_all(EngineStoppedError("the server shut down before this request finished"))
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    # ----- requests (event-loop thread) -----
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None,
                          arrival_time: float | None = None, priority: int = 0,
                          cache_salt: str | None = None, lora_request=None, pooling_params=None,
                          beam_search=None) -> RequestStream:
        """Queue a request (a pooling one with pooling_params and no params); raises InvalidRequestError (bad
        request) or EngineOverloadedError (queue full)."""
        self._check_can_accept()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if params is None:
            params = SamplingParams()   # a pooling request's: the engine replaces it
        if params.output_kind != RequestOutputKind.DELTA:
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # the id is taken and the request counts as waiting from here on, through its grammar's compilation too
        stream = self._streams[request_id] = RequestStream(request_id)
        self._num_pending_adds += 1
        if params.structured_outputs is not None:
            try:
                await self._compile_grammar(params)
                self._check_alive()
                if stream.aborted or not self._accepting:   # shut down while it compiled
                    raise EngineStoppedError("the server is shutting down and takes no new requests")
            except BaseException:
                self._num_pending_adds -= 1
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
                raise
        stream.add_future = self._loop.create_future()
        add = functools.partial(self._add_on_engine, request_id, prompt, params, arrival_time, priority, cache_salt,
                                lora_request, pooling_params, beam_search)
        self._submit(functools.partial(self._run_command, add, stream.add_future))
        try:
            await stream.add_future
        except asyncio.CancelledError:
            self.abort(request_id)   # queued after the add, so it runs after it
            raise
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            raise
        finally:
            self._num_pending_adds -= 1
            stream.add_future = None
        return stream

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Wait for the request's grammar off the engine thread, so a constraint that does not compile (or not in
        time) is refused before the request is queued, and the response (a stream too) has not begun."""
        manager = self.engine.structured_output
        fut = asyncio.wrap_future(manager.submit(params.structured_outputs))
        done, _ = await asyncio.wait({fut}, timeout=manager.compile_timeout_s)   # wait() never cancels the compile
        if not done:
            raise compile_timeout_error(manager.compile_timeout_s)
        fut.result()   # the compile error, if any

    def generate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; aborts it if the consumer stops early."""
        return stream_outputs(stream, self.abort)

    def abort(self, request_id: str) -> None:
        """Abort a request: its KV blocks are freed before the next step."""
        stream = self._streams.get(request_id)
        if stream is None or stream.aborted:
            return
        stream.aborted = True
        self._submit(lambda: self._abort_on_engine([request_id]))

    def abort_all(self, error: BaseException) -> None:
        """Abort every request, ending each stream with `error`."""
        ids = [rid for rid, s in self._streams.items() if not s.aborted]
        for rid in ids:
            stream = self._streams[rid]
            stream.aborted = True
            stream.put(error)
            if stream.add_future is not None:   # still queued behind a step: tell its caller now
                _set_exception(stream.add_future, error)
        if ids:
            self._submit(lambda: self._abort_on_engine(ids))

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition of the engine's metrics."""
        return self.metrics.render()

    async def call_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        self._check_alive()
        return await self._call(lambda: fn(self.engine))

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine failed and cannot serve requests: {self.dead_error}")

    def _check_can_accept(self) -> None:
        self._check_alive()
        if not self._accepting or self._loop is None:
            raise EngineStoppedError("the server is shutting down and takes no new requests")
        limit = self.max_waiting_requests
        if limit is not None and self._num_waiting + self._num_pending_adds >= limit:
            raise EngineOverloadedError(f"the server is overloaded: {limit} requests are already waiting "
                                        "(--max-waiting-requests); retry later")

    async def _call(self, fn: Callable[[], Any]) -> Any:
        fut = self._loop.create_future()
        self._submit(functools.partial(self._run_command, fn, fut))
        return await fut

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand one step's outputs to their streams (on the event loop)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.aborted:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None and stream.aborted:
                del self._streams[rid]

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None and not stream.aborted:
                stream.put(error)

    # ----- engine thread -----
    def _run(self) -> None:
        try:
            if self.engine.num_threads is not None:   # thread counts are per OS thread in OpenMP
                torch.set_num_threads(self.engine.num_threads)
            use_device(self.engine.device)   # as is the current CUDA device
            while not self._stop:
                self._run_commands()
                if not self.engine.has_unfinished_requests():
                    self.stat_logger.maybe_log(self._update_stats())
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                self._step()
            self._run_commands()
        except BaseException as e:   # a failure outside a step (abort or bookkeeping): nothing can be trusted
            logger.exception("engine thread failed; the engine is dead")
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """The engine cannot serve any more: fail every request, stop the engine thread, tell on_dead (once)."""
        if self.dead_error is not None:
            return
        self.dead_error = error
        self._stop = True
        self._wakeup.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.abort_all, EngineDeadError(f"the engine failed: {error}"))
        for callback in self.on_dead:
            callback()

    def _run_commands(self) -> None:
        if not self._commands:
            return   # nothing changed since the last step refreshed the stats
        while self._commands:
            self._commands.popleft()()
        self._update_stats()

    def _run_command(self, fn: Callable[[], Any], fut: asyncio.Future) -> None:
        try:
            result = fn()
        except Exception as e:
            self._loop.call_soon_threadsafe(_set_exception, fut, e)
        else:
            self._loop.call_soon_threadsafe(_set_result, fut, result)

    def _add_on_engine(self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float,
                       priority: int, cache_salt: str | None, lora_request, pooling_params, beam_search) -> None:
        self.engine.add_request(request_id, prompt, params, arrival_time, priority, cache_salt, lora_request,
                                pooling_params, beam_search)
        self._engine_ids.add(request_id)

    def _abort_on_engine(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._engine_ids]
        self._engine_ids.difference_update(live)
        outputs = self.engine.abort_request(live) if live else []
        self.metrics.record_outputs(outputs)
        self._loop.call_soon_threadsafe(self._forget, request_ids)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise   # _run: the engine is dead
        except Exception as e:
            # the engine fails a broken forward pass's requests itself (take_failed_requests); an error here came
            # from its bookkeeping, so no request's state can be trusted: all in flight get a 500, and the engine
            # goes on serving new ones
            logger.exception("engine step failed; aborting the %d request(s) in flight", len(self._engine_ids))
            ids = list(self._engine_ids)
            self._abort_on_engine(ids)
            self._loop.call_soon_threadsafe(self._fail, ids, RequestFailedError(f"the engine step failed: {e!r}"))
            return
        failed = self.engine.take_failed_requests()
        if failed:
            self._engine_ids.difference_update(failed)
            for rid, error in failed.items():
                self._loop.call_soon_threadsafe(self._fail, [rid], error)
        now = time.monotonic()
        for out in outputs:
            if out.finished:
                self._engine_ids.discard(out.request_id)
        self.metrics.record_outputs(outputs, now)
        stats = self._update_stats()
        self._loop.call_soon_threadsafe(self._dispatch, outputs)
        self.stat_logger.maybe_log(stats, now)

    def _update_stats(self) -> SchedulerStats:
        stats = self.engine.scheduler.stats()
        self._num_waiting = stats.num_waiting
        self.metrics.update_scheduler(stats)
        return stats


def _set_result(fut: asyncio.Future, result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
