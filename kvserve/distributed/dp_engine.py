"""DataParallelEngine: the server's engine over data-parallel replicas on Ray (kvserve/distributed/replicas.py).

It offers what the OpenAI server uses of AsyncLLMEngine (add_request, generate, abort, call_engine, metrics,
health, start/stop), so the HTTP layer is the same for one engine and for N replicas.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvserve.distributed.metrics import merge_replica_metrics
from kvserve.distributed.replicas import ReplicaActor, ReplicaSummary, unpack_error
from kvserve.distributed.router import PrefixRouter
from kvserve.engine.async_engine import EngineStoppedError, RequestStream, stream_outputs
from kvserve.errors import EngineDeadError, InvalidRequestError, LoRAError, ModelLoadError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("kvserve.engine")

_POLL_S = 1.0


class DataParallelEngine:
    """N engine replicas as Ray actors behind one server: routes, streams, aggregates metrics."""

    def __init__(self, config, num_replicas: int, model_name: str, max_waiting_requests: int | None = None):
        import ray
        from kvserve.model import load_tokenizer, resolve_device
        from kvserve.engine.llm_engine import _read_template
        if config.enable_lora:
            raise LoRAError("LoRA adapters are not served by data-parallel replicas yet")
        if not ray.is_initialized():
            ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
        cores = int(ray.available_resources().get("CPU", os.cpu_count() or 1))
        per_replica = max(1, cores // num_replicas)
        # on GPUs a replica reserves one per tensor-parallel rank: Ray shows it those only, as cuda:0..tp-1
        gpus = config.tensor_parallel_size if resolve_device(config.device).type == "cuda" else 0
        actor = ray.remote(ReplicaActor)
        self.replicas = [actor.options(num_cpus=per_replica, num_gpus=gpus).remote(
            config, model_name, max_waiting_requests, max(1, per_replica // config.tensor_parallel_size))
            for _ in range(num_replicas)]
        self.num_replicas = num_replicas
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        if config.chat_template:
            self.tokenizer.chat_template = _read_template(config.chat_template)
        self.engine: ReplicaSummary | None = None   # set by describe()
        self.router: PrefixRouter | None = None
        self.dead_error: BaseException | None = None
        self.on_dead: list[Callable[[], None]] = []
        self._streams: dict[str, tuple[RequestStream, int]] = {}
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self.describe()

    def describe(self) -> None:
        """Start every replica's engine (blocking, at server start) and read what the server shows."""
        import ray
        try:
            infos = ray.get([r.start.remote() for r in self.replicas])
        except ray.exceptions.RayError as e:
            for r in self.replicas:
                ray.kill(r)
            raise ModelLoadError(f"a data-parallel replica failed to start: {e}") from e
        self.engine = ReplicaSummary(**infos[0], num_replicas=self.num_replicas)
        self.router = PrefixRouter(self.num_replicas, self.engine.block_size, self.engine.num_kv_blocks)

    # ----- life cycle -----
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [self._loop.create_task(self._poll(i)) for i in range(self.num_replicas)]

    def begin_shutdown(self, grace_s: float) -> None:
        if not self._accepting or self._loop is None:
            return
        self._accepting = False
        self._loop.call_soon_threadsafe(self._loop.call_later, grace_s, self.abort_all,
                                        EngineStoppedError("the server shut down before this request finished"))

    async def stop(self) -> None:
        import ray
        self._accepting = False
        self.abort_all(EngineStoppedError("the server shut down before this request finished"))
        for task in self._tasks:
            task.cancel()
        live = [r for i, r in enumerate(self.replicas) if self.router.alive[i]]
        await asyncio.gather(*(r.stop.remote() for r in live), return_exceptions=True)
        for r in self.replicas:
            ray.kill(r)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and any(self.router.alive)

    # ----- requests -----
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None, priority: int = 0,
                          cache_salt: str | None = None, lora_request=None, pooling_params=None,
                          beam_search=None) -> RequestStream:
        """Route and queue a request on a replica; raises as AsyncLLMEngine.add_request does."""
        self._check_can_accept()
        if lora_request is not None:
            raise LoRAError("LoRA adapters are not served by data-parallel replicas yet")
        if pooling_params is not None or beam_search is not None:
            raise InvalidRequestError("embeddings and beam search are not served by data-parallel replicas yet",
                                      "model")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if params.output_kind != RequestOutputKind.DELTA:
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if token_ids is None:   # text: tokenized here too, for routing (the replica tokenizes it the same way)
            text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
            token_ids = self.tokenizer.encode(text) if isinstance(text, str) else []
        hashes = self.router.block_hashes(list(token_ids), cache_salt)
        while True:   # a replica that dies before it took the request: the request goes to another
            self._check_can_accept()   # also after a replica died: the server may be shutting down meanwhile
            try:
                replica = self.router.choose(hashes)
            except ValueError:
                raise EngineDeadError("every data-parallel replica has died") from None
            stream = RequestStream(request_id)
            self._streams[request_id] = (stream, replica)
            self.router.started(replica, hashes)
            try:
                error = await self.replicas[replica].add.remote(request_id, prompt, params, priority, cache_salt)
            except BaseException as e:
                self._forget(request_id)
                if not _is_actor_death(e):
                    if isinstance(e, asyncio.CancelledError):   # the client left: the replica may have queued it
                        self.replicas[replica].abort.remote(request_id, before_add=True)
                    raise
                self._replica_died(replica, f"{type(e).__name__}: {e}")
                continue
            if error is not None:
                self._forget(request_id)
                e = unpack_error(error)
                if isinstance(e, EngineDeadError):   # its engine died, the actor lives on
                    self._replica_died(replica, str(e))
                    continue
                raise e
            return stream

    def _check_can_accept(self) -> None:
        """Each replica applies max_waiting_requests to its own queue (EngineOverloadedError comes back from it)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine failed and cannot serve requests: {self.dead_error}")
        if not self._accepting or self._loop is None:
            raise EngineStoppedError("the server is shutting down and takes no new requests")

    def generate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        return stream_outputs(stream, self.abort)

    def abort(self, request_id: str) -> None:
        entry = self._streams.get(request_id)
        if entry is None or entry[0].aborted:
            return
        entry[0].aborted = True
        self._forget(request_id)
        if self.router.alive[entry[1]]:
            self.replicas[entry[1]].abort.remote(request_id)

    def abort_all(self, error: BaseException) -> None:
        for rid in list(self._streams):
            stream, _ = self._streams[rid]
            stream.put(error)
            self.abort(rid)

    def _forget(self, request_id: str) -> None:
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            self.router.finished(entry[1])

    async def call_engine(self, fn: Callable) -> Any:
        """fn(engine) on every live replica's engine thread; True where every replica returned a true value."""
        results = await asyncio.gather(*(r.call.remote(fn) for i, r in enumerate(self.replicas)
                                         if self.router.alive[i]))
        return all(results)

    async def render_metrics(self) -> bytes:
        """Every live replica's metrics labelled engine="i", and their totals labelled engine="total"."""
        live = [i for i in range(self.num_replicas) if self.router.alive[i]]
        texts = await asyncio.gather(*(self.replicas[i].metrics.remote() for i in live), return_exceptions=True)
        return merge_replica_metrics({i: t for i, t in zip(live, texts) if isinstance(t, bytes)})

    # ----- replica outputs -----
    async def _poll(self, replica: int) -> None:
        handle = self.replicas[replica]
        try:
            while self.router.alive[replica]:
                items, dead = await handle.poll.remote(_POLL_S)
                for request_id, item in items:
                    self._deliver(replica, request_id, item)
                if dead is not None:
                    self._replica_died(replica, f"its engine died ({dead})")
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001 - a Ray actor error: the replica is gone
            self._replica_died(replica, f"{type(e).__name__}: {e}")

    def _deliver(self, replica: int, request_id: str, item: Any) -> None:
        entry = self._streams.get(request_id)
        if entry is None or entry[0].aborted or entry[1] != replica:   # a stale output of an earlier attempt
            return
        stream = entry[0]
        if isinstance(item, tuple):   # a packed error ends the request
            stream.put(unpack_error(item))
            self._forget(request_id)
            return
        stream.put(item)
        if item.finished:
            self._forget(request_id)

    def _replica_died(self, replica: int, why: str) -> None:
        import ray
        if not self.router.alive[replica]:
            return
        logger.error("kvserve: data-parallel replica %d died (%s); it is out of rotation", replica, why)
        self.router.remove(replica)
        ray.kill(self.replicas[replica])   # a live actor whose engine died still holds its memory and CPUs
        failure = EngineDeadError(f"data-parallel replica {replica} died while serving this request")
        for rid, (stream, r) in list(self._streams.items()):
            if r == replica:
                stream.put(failure)
                stream.aborted = True
                self._forget(rid)
        if not any(self.router.alive):
            self.dead_error = EngineDeadError("every data-parallel replica has died")
            for callback in self.on_dead:
                callback()


def _is_actor_death(e: BaseException) -> bool:
    import ray
    return isinstance(e, ray.exceptions.RayActorError)
