"""LoRAManager: the adapters of one engine, in three tiers.

    named (registry: what a server serves)  ->  in memory (max_cpu_loras, LRU)  ->  in slots (max_loras, LRU)
    a request's adapter not in memory loads on a background thread; the scheduler holds the request back
    (is_ready) and runs the others meanwhile; each step puts the adapters of its requests into slots (activate)
    an adapter a request in flight uses stays in memory until the request ends (pin / unpin), beyond
    max_cpu_loras if need be

An adapter's identity is its lora_int_id: one id always means the same name and path.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvserve import kernels
from kvserve.errors import LoRAError
from kvserve.lora.adapter import LoRAAdapter, load_adapter
from kvserve.lora.layers import install_lora, projection_shapes
from kvserve.lora.request import LoRARequest

logger = logging.getLogger("kvserve")


class LoRAManager:
    """Loads, caches and places LoRA adapters for one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 shard=None, full_config=None):
        """shard, full_config: a tensor-parallel rank's ShardPlan and the whole model's config: adapters are
        checked against the whole model's shapes, then cut to the rank's part (ShardPlan.shard_lora)."""
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.mapping, self.tables = install_lora(model, max_loras, max_lora_rank)
        self.shard = shard
        if shard is not None:
            from kvserve.distributed.plan import full_projection_shapes
            self.shapes = full_projection_shapes(full_config)
        else:
            self.shapes = projection_shapes(model)
        self.num_layers = len(model.model.layers)
        self.slots: list[int | None] = [None] * max_loras   # adapter id in each slot
        self._slot_used = [0] * max_loras                    # step counter of each slot's last use (LRU)
        self._clock = 0
        self.registry: dict[str, LoRARequest] = {}           # served adapters, by name
        self._by_id: dict[int, LoRARequest] = {}
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._loading: dict[int, Future] = {}
        self._refs: dict[int, int] = {}                      # adapter id -> requests in flight using it
        self.num_loads = 0                                   # reads from disk (tests, metrics)
        self.num_slot_writes = 0
        self._last_id = 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-lora")

    @property
    def table_bytes(self) -> int:
        """Memory of the slot tables (all max_loras slots at max_lora_rank)."""
        return sum(t.nbytes for t in self.tables.values())

    # ----- loading (any thread) -----
    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in memory, read from disk first if needed; raises LoRAError for a bad one."""
        self._check_identity(request)
        with self._lock:
            adapter = self._cpu.get(request.lora_int_id)
            if adapter is not None:
                self._cpu.move_to_end(request.lora_int_id)
                return adapter
        try:
            adapter = load_adapter(request, self.shapes, self.num_layers, self.max_lora_rank)
            if self.shard is not None:
                adapter.weights = {key: self.shard.shard_lora(key[1], key[2], a, b)
                                   for key, (a, b) in adapter.weights.items()}
        except LoRAError:
            raise
        except Exception as e:   # anything else a malformed adapter can raise is still the adapter's fault
            raise LoRAError(f"cannot load the LoRA adapter at {request.lora_path}: {type(e).__name__}: {e}") from e
        finally:   # a loader thread's workers (its tensor ops) would slow the engine thread's parallel regions
            kernels.release_openmp_workers()
        with self._lock:
            self._by_id.setdefault(request.lora_int_id, request)
            self._cpu[request.lora_int_id] = adapter
            self.num_loads += 1
            self._evict(keep=request.lora_int_id)   # its request pins it only once queued
        logger.info("kvserve: loaded LoRA adapter %r (rank %d, %s) from %s in %.2f s", request.lora_name,
                    adapter.rank, ", ".join(adapter.target_modules), request.lora_path, adapter.load_time_s)
        return adapter

    def _check_identity(self, request: LoRARequest) -> None:
        with self._lock:
            known = self._by_id.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise LoRAError(f"lora_int_id {request.lora_int_id} already names the adapter {known.lora_name!r} at "
                            f"{known.lora_path}; give {request.lora_name!r} at {request.lora_path} another id")

    def prepare(self, request: LoRARequest) -> None:
        """Check a request's adapter before the request queues: one seen before passes (if it has left memory it
        loads again when the request is scheduled); a new one is loaded now, so a bad adapter is refused up front."""
        self._check_identity(request)
        with self._lock:
            known = request.lora_int_id in self._by_id
        if not known:
            self.load(request)

    def loading(self) -> list[Future]:
        """The loads in progress."""
        with self._lock:
            return [f for f in self._loading.values() if not f.done()]

    def register(self, request: LoRARequest) -> LoRAAdapter:
        """Load and serve an adapter under its name; LoRAError if the name is taken or the adapter is bad."""
        self._check_name_free(request.lora_name)
        adapter = self.load(request)
        with self._lock:   # checked again: two loads of one name may have run side by side
            self._check_name_free(request.lora_name)
            self.registry[request.lora_name] = request
        return adapter

    def _check_name_free(self, name: str) -> None:
        if name in self.registry:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded; unload it first", "lora_name")

    def unregister(self, name: str) -> LoRARequest | None:
        """Stop serving a named adapter (requests already running with it finish with it); None if none is named
        so."""
        with self._lock:
            request = self.registry.pop(name, None)
            if request is not None and request.lora_int_id not in self._refs:
                self._cpu.pop(request.lora_int_id, None)
        return request

    def next_id(self) -> int:
        """An adapter id no adapter has used yet (for adapters a server names)."""
        with self._lock:
            self._last_id = max(self._last_id, max(self._by_id, default=0)) + 1
            return self._last_id

    # ----- scheduling (engine thread) -----
    def is_ready(self, request: LoRARequest) -> bool:
        """True when the adapter is in memory; else starts loading it (unless a load runs) and returns False. Raises
        the LoRAError of a load that failed (once; a later request tries again)."""
        rid = request.lora_int_id
        with self._lock:
            future = self._loading.get(rid)
            if future is not None:
                if not future.done():
                    return False
                del self._loading[rid]
            if rid in self._cpu:
                self._cpu.move_to_end(rid)
                return True
            if future is None or future.exception() is None:   # never loaded, or loaded and dropped since
                self._loading[rid] = self._executor.submit(self.load, request)
                return False
        future.result()   # raises the load's LoRAError
        return True

    def pin(self, lora_id: int) -> None:
        """A request in flight uses this adapter: once in memory it stays there until unpin (so a step never reads
        the disk for it, and an unloaded adapter serves its running requests to the end)."""
        with self._lock:
            self._refs[lora_id] = self._refs.get(lora_id, 0) + 1

    def unpin(self, lora_id: int) -> None:
        with self._lock:
            refs = self._refs.get(lora_id, 0) - 1
            if refs > 0:
                self._refs[lora_id] = refs
            else:
                self._refs.pop(lora_id, None)
            self._evict()

    def _evict(self, keep: int | None = None) -> None:
        """Drop the least recently used adapters no request in flight uses (nor `keep`), down to max_cpu_loras
        (under the lock)."""
        while len(self._cpu) > self.max_cpu_loras:
            victim = next((rid for rid in self._cpu if rid not in self._refs and rid != keep), None)
            if victim is None:
                return
            del self._cpu[victim]

    def activate(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Put these adapters (at most max_loras: the scheduler's limit) into slots, evicting the least recently
        used others; returns adapter id -> slot."""
        self._clock += 1
        wanted = {r.lora_int_id: r for r in requests}
        placed = {rid: self.slots.index(rid) for rid in wanted if rid in self.slots}
        for rid, request in wanted.items():
            if rid not in placed:
                free = [s for s in range(self.max_loras) if self.slots[s] not in wanted]
                if not free:
                    raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters, more than max_loras={self.max_loras}")
                placed[rid] = slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_used[s]))
                self._write_slot(slot, self.load(request))   # in memory already, unless evicted meanwhile
        for slot in placed.values():
            self._slot_used[slot] = self._clock
        return placed

    def slot_table(self, placed: dict[int, int]) -> list[list]:
        """[slot, id, name, path] of the adapters a step placed (activate's result), for the step message."""
        with self._lock:
            return [[slot, rid, self._by_id[rid].lora_name, self._by_id[rid].lora_path]
                    for rid, slot in sorted(placed.items(), key=lambda item: item[1])]

    def mirror(self, table: list[list]) -> None:
        """A tensor-parallel worker: put the adapters of the driver's slot_table in the same slots (loading them
        from disk the first time); a no-op where the slots hold them already, as on the driver."""
        for slot, rid, name, path in table:
            if self.slots[slot] != rid:
                self._write_slot(slot, self.load(LoRARequest(name, rid, path)))

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for table in self.tables.values():
            table.clear_slot(slot)
        for (layer, linear, shard), (a, b) in adapter.weights.items():
            self.tables[(layer, linear)].set_slot(slot, shard, a, b)
        self.slots[slot] = adapter.request.lora_int_id
        self.num_slot_writes += 1

    def adapter_names(self, ids) -> list[str]:
        with self._lock:
            return sorted({self._by_id[i].lora_name for i in ids if i in self._by_id})
