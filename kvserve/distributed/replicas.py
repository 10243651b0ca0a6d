"""Data-parallel replicas on Ray: N engines, each a Ray actor (itself possibly tensor-parallel), behind one server.

    OpenAI server (this process)                    Ray actor "replica i" (any machine of the cluster)
    DataParallelEngine.add_request --PrefixRouter--> ReplicaActor.add -> AsyncLLMEngine (its engine thread)
    RequestStream.get  <---- poll loop per replica <- ReplicaActor.poll (every output since the last poll)
    /metrics: every replica's metrics labelled engine="i", and engine="total"

A replica that dies is taken out of rotation: its requests fail with EngineDeadError, the others go on; when none
is left the server stops. The frontend tokenizes and routes; replicas receive token ids.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvserve.engine.async_engine import RequestStream
from kvserve.errors import KVServeError, RequestFailedError
from kvserve.sampling_params import SamplingParams


def pack_error(e: BaseException) -> tuple:
    """An exception as plain values (pickling drops InvalidRequestError's param)."""
    cls = type(e) if isinstance(e, KVServeError) else RequestFailedError
    return cls.__module__, cls.__qualname__, str(e), getattr(e, "param", None)


def unpack_error(packed: tuple) -> KVServeError:
    module, name, message, param = packed
    cls = getattr(importlib.import_module(module), name)
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    e.message, e.param = message, param
    return e


class ReplicaActor:
    """One replica: an LLMEngine served by an AsyncLLMEngine inside a Ray actor (async methods: its event loop)."""

    def __init__(self, config, model_name: str, max_waiting_requests: int | None, num_threads: int):
        from kvserve.engine.async_engine import AsyncLLMEngine
        from kvserve.engine.llm_engine import LLMEngine
        from kvserve.metrics import EngineMetrics
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = dataclasses.replace(config, num_threads=config.num_threads or num_threads,
                                     distributed_executor_backend="mp")   # its own TP ranks: local processes
        self.llm = LLMEngine(config)
        self.engine = AsyncLLMEngine(self.llm, max_waiting_requests, EngineMetrics(model_name))
        self.outbox: list[tuple[str, Any]] = []
        self.ready: asyncio.Event | None = None
        # aborts that arrived before their add (an async actor runs calls in any order); bounded, oldest dropped
        self.early_aborts: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> dict:
        """Start the engine thread; returns what the server shows of the engine."""
        self.engine.start()
        self.ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        # an engine that dies (its thread failed, one of its tensor-parallel workers died) wakes the poll
        self.engine.on_dead.append(lambda: loop.call_soon_threadsafe(self.ready.set))
        e = self.llm
        return {"max_model_len": e.max_model_len, "vocab_size": e.vocab_size, "dtype": e.dtype,
                # blocks of the longest sequence (the router's capacity; with KV groups, not the pool's pages)
                "num_kv_blocks": e.num_kv_pool_tokens // e.block_size, "block_size": e.block_size,
                "kernel_summary": e.kernel_summary,
                "weights_summary": e.weights_summary, "kv_cache": e.kv_cache_description(),
                "parallel": e.parallel_description()}

    async def add(self, request_id: str, prompt: Any, params: SamplingParams, priority: int,
                  cache_salt: str | None) -> tuple | None:
        """Queue a request; None, or its error packed."""
        if request_id in self.early_aborts:   # its abort came first: the frontend has given up on it
            del self.early_aborts[request_id]
            return pack_error(RequestFailedError("the request was aborted before it started"))
        try:
            stream = await self.engine.add_request(request_id, prompt, params, priority=priority,
                                                   cache_salt=cache_salt)
        except Exception as e:   # noqa: BLE001 - handed back to the frontend
            return pack_error(e)
        asyncio.get_running_loop().create_task(self._pump(stream))
        return None

    async def _pump(self, stream: RequestStream) -> None:
        try:
            async for out in self.engine.generate(stream):
                self._send(stream.request_id, out)
        except Exception as e:   # noqa: BLE001 - the request's error, for its stream
            self._send(stream.request_id, pack_error(e))

    def _send(self, request_id: str, item: Any) -> None:
        self.outbox.append((request_id, item))
        self.ready.set()

    async def poll(self, timeout_s: float) -> tuple[list[tuple[str, Any]], str | None]:
        """Every output (or packed error) since the last poll, waiting up to timeout_s for one; and why the engine
        died, once it has (the replica is then of no more use)."""
        if not self.outbox and self.engine.dead_error is None:
            try:
                await asyncio.wait_for(self.ready.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        self.ready.clear()
        out, self.outbox = self.outbox, []
        dead = self.engine.dead_error
        return out, None if dead is None else f"{type(dead).__name__}: {dead}"

    async def abort(self, request_id: str, before_add: bool = False) -> None:
        """Abort a request; before_add: the frontend gave up while its add was on the way, which may run later."""
        if before_add and request_id not in self.engine._streams:
            self.early_aborts[request_id] = None
            while len(self.early_aborts) > 10_000:
                self.early_aborts.popitem(last=False)
        self.engine.abort(request_id)

    async def metrics(self) -> bytes:
        return self.engine.metrics.render()

    async def call(self, fn: Callable) -> Any:
        return await self.engine.call_engine(fn)

    async def stop(self) -> None:
        await self.engine.stop()
        self.llm.shutdown()

    def pid(self) -> int:
        return os.getpid()


@dataclasses.dataclass
class ReplicaSummary:
    """What the server reads of `engine.engine` (replica 0's, as every replica loads the same model)."""

    max_model_len: int
    vocab_size: int
    dtype: Any
    num_kv_blocks: int
    block_size: int
    kernel_summary: str
    weights_summary: str
    kv_cache: str
    parallel: str
    num_replicas: int = 1
    lora = None

    def kv_cache_description(self) -> str:
        return self.kv_cache

    def parallel_description(self) -> str:
        return f", {self.num_replicas} data-parallel replicas on Ray{self.parallel}"

    def shutdown(self) -> None:
        pass
