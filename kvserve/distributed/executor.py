"""TPExecutor: tensor parallelism's processes. The engine's process is rank 0 (the driver: scheduler, sampling and
shard 0); ranks 1..N-1 are worker processes ("mp", started here) or Ray actors ("ray", on any machine of the
cluster), each holding its own shard and KV pools.

    driver (rank 0)                               worker (rank r)
    schedule -> StepMessage -----send_bytes-----> StepMessage
    forward on shard 0  <====== gloo all-reduce ======>  forward on shard r
    compute_logits      <====== gloo gather  ==========  compute_logits
    sample, detokenize

Steps go over one authenticated connection per worker (multiprocessing.connection over TCP); the collectives
over a gloo group of the engine's own (NCCL on CUDA). A worker that dies closes both: the driver's next send or
collective raises EngineDeadError, and a monitor thread reports the death at once, also while the engine is idle.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np
import torch

from kvserve.errors import EngineDeadError, KVServeError, ModelLoadError
from kvserve.distributed.comm import TPComm, create_shm_segment
from kvserve.distributed.message import StepMessage
from kvserve.distributed.plan import ShardPlan, make_plans

logger = logging.getLogger("kvserve")

START_TIMEOUT_S = float(os.environ.get("KVSERVE_TP_START_TIMEOUT_S", "600"))   # workers loading their shards
_STEP, _COPY, _QUIT = b"S", b"C", b"Q"


@dataclasses.dataclass
class WorkerArgs:
    """What a worker needs to start: the engine's config, its rank, and where the driver listens."""

    config: Any
    rank: int
    size: int
    host: str
    store_port: int
    address: tuple[str, int]
    authkey: bytes
    num_threads: int
    local_process: bool   # mp: a process the driver started on its machine (exits with it); else a Ray actor
    driver_pid: int
    shm_path: str | None     # the shared-memory all-reduce's segment (ranks on the driver's machine)


class TPExecutor:
    """The driver's side of a tensor-parallel group: starts the workers, sends them every step, stops them."""

    def __init__(self, config, device: torch.device, num_threads: int):
        self.size = config.tensor_parallel_size
        self.backend = config.distributed_executor_backend or "mp"
        self.device = device
        self.plans: list[ShardPlan] | None = None
        self.dead_error: str | None = None
        self.on_dead: list[Callable[[str], None]] = []   # told once when a worker dies
        self._stopping = False
        self.previous_num_threads: int | None = None   # set by start_tensor_parallel
        self._procs: list[Any] = []      # subprocess.Popen (mp) or Ray actor handles
        self._ray_refs: list[Any] = []   # each Ray worker's running loop
        host = _ray_node_ip() if self.backend == "ray" else "127.0.0.1"
        self.store = TPComm.make_store(host, self.size)
        authkey = secrets.token_bytes(16)
        self.listener = Listener((host, 0), authkey=authkey)
        # ranks on this machine all-reduce through shared memory; Ray's may be on other machines: gloo
        self.shm_path = create_shm_segment(self.size) if self.backend == "mp" and device.type == "cpu" else None
        args = [WorkerArgs(config, r, self.size, host, self.store.port, self.listener.address, authkey, num_threads,
                           self.backend == "mp", os.getpid(), self.shm_path) for r in range(1, self.size)]
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self.conns, self._procs, self.listener, self.shm_path)
        self._start_workers(args)
        self.conns.extend(self._accept(args))
        self.comm = TPComm(host, self.store.port, 0, self.size, device, store=self.store, shm_path=self.shm_path)
        # holds the executor weakly: an engine dropped without shutdown() is collected, and its finalizer stops the
        # workers
        threading.Thread(target=_monitor, args=(weakref.ref(self),), name="kvserve-tp-monitor", daemon=True).start()

    # ----- start-up -----
    def _start_workers(self, args: list[WorkerArgs]) -> None:
        """Start a process or actor per worker rank; each connects back and is sent its WorkerArgs (_accept)."""
        if self.backend == "ray":
            import ray
            if not ray.is_initialized():
                ray.init(address=args[0].config.ray_address, log_to_driver=True, include_dashboard=False)
            actor = ray.remote(_RayWorker)
            for a in args:
                handle = actor.options(num_cpus=a.num_threads, num_gpus=int(self.device.type == "cuda")).remote()
                self._procs.append(handle)
                self._ray_refs.append(handle.run.remote(a.address, a.authkey, a.rank))
            return
        # a fresh interpreter, not multiprocessing's spawn: that would re-import the user's __main__ script,
        # which then needs an `if __name__ == "__main__"` guard
        for a in args:
            env = dict(os.environ, KVSERVE_TP_AUTHKEY=a.authkey.hex())
            cmd = [sys.executable, "-m", "kvserve.distributed.executor", f"{a.address[0]}:{a.address[1]}", str(a.rank)]
            self._procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))

    def _accept(self, args: list[WorkerArgs]) -> list[Connection]:
        """One connection per worker, in rank order; a worker that dies first fails the start."""
        conns: dict[int, Connection] = {}

        def accept_all():
            try:
                while len(conns) < len(args):
                    conn = self.listener.accept()
                    rank = conn.recv()
                    conn.send(args[rank - 1])
                    conns[rank] = conn
            except (OSError, EOFError):   # the listener was closed: the start failed
                pass

        thread = threading.Thread(target=accept_all, name="kvserve-tp-accept", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive():
            thread.join(timeout=0.5)
            try:
                self._check_started(deadline)
            except ModelLoadError:
                self.shutdown()
                raise
        if sorted(conns) != list(range(1, len(args) + 1)):
            self.shutdown()
            raise ModelLoadError(f"tensor-parallel workers {sorted(conns)} connected, expected ranks 1..{len(args)}")
        return [conns[r] for r in sorted(conns)]

    def _check_started(self, deadline: float) -> None:
        dead = self._dead_workers()
        if dead:
            raise ModelLoadError(f"tensor-parallel worker(s) {dead} exited while starting; see their log above")
        if time.monotonic() > deadline:
            raise ModelLoadError(f"tensor-parallel workers did not start within {START_TIMEOUT_S:.0f} s")

    def plan(self, cfg) -> ShardPlan:
        """Rank 0's shard plan (validated by the engine before the workers started)."""
        self.plans = make_plans(cfg, self.size)
        return self.plans[0]

    def attach(self, model, vocab_size: int) -> None:
        """Make the driver's model shard 0 of the group."""
        p = self.plans[0]
        model.set_tensor_parallel(self.comm, p.vocab[0], p.vocab_per_rank, vocab_size)

    def wait_ready(self, kind: str) -> None:
        """Wait until every worker reports `kind` ("loaded" or "kv"); a worker's error fails the start with it.
        Once loaded, every rank has mapped the shared-memory segment: its file goes (the mappings stay)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(1.0):
                self._check_started(deadline)
            reply = conn.recv()
            if reply[0] == "error":
                raise ModelLoadError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")
            if reply[0] != kind:
                raise ModelLoadError(f"tensor-parallel rank {rank} answered {reply[0]!r}, expected {kind!r}")
        if kind == "loaded":
            _unlink(self.shm_path)

    def init_kv_cache(self, num_blocks: int) -> None:
        """The workers' pools get the driver's number of blocks (the scheduler addresses all ranks' pools alike)."""
        for conn in self.conns:
            conn.send(("kv", num_blocks))
        self.wait_ready("kv")

    # ----- steps -----
    def send_step(self, msg: StepMessage) -> None:
        self._send(_STEP + msg.encode())

    def _send(self, data: bytes) -> None:
        self._check_alive()
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            self._died(f"sending a step to a tensor-parallel worker failed: {e}")
            self._check_alive()

    def send_block_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies made between steps (a draft model's proposal allocating blocks): the workers
        copy their pools' blocks before the next step."""
        self._send(_COPY + np.asarray(copies, np.int64).tobytes())

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        self.comm.raise_if_failed()

    # ----- liveness and shutdown -----
    def _dead_workers(self) -> list[str]:
        if self.backend == "ray":
            import ray
            done, _ = ray.wait(self._ray_refs, num_returns=len(self._ray_refs), timeout=0)
            return [f"rank {self._ray_refs.index(r) + 1}" for r in done]
        return [f"rank {i} (exit code {p.returncode})" for i, p in enumerate(self._procs, start=1)
                if p.poll() is not None]

    def fail(self, message: str) -> None:
        """The group cannot go on (rank 0 failed inside a step): the engine is dead, waiting ranks are woken."""
        self._died(message)

    def _died(self, message: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = message
        logger.error("kvserve: %s; the engine cannot go on", message)
        if getattr(self, "comm", None) is not None:
            self.comm.abort()   # ranks waiting in a shared-memory all-reduce
        for callback in self.on_dead:
            callback(message)

    def shutdown(self) -> None:
        """Stop the workers (idempotent), and give this thread back the thread count it had before the start."""
        self._stopping = True
        self._finalizer()
        if self.previous_num_threads is not None:
            torch.set_num_threads(self.previous_num_threads)
            self.previous_num_threads = None


def _monitor(ref: weakref.ref) -> None:
    """Report a worker's death as it happens (the engine may be idle, with no collective to fail)."""
    while True:
        executor = ref()
        if executor is None or executor._stopping:
            return
        dead = executor._dead_workers()
        if dead:
            executor._died(f"tensor-parallel worker {', '.join(dead)} died")
            return
        backend, refs = executor.backend, executor._ray_refs
        del executor
        if backend == "ray":
            import ray
            ray.wait(refs, num_returns=1, timeout=0.2)
        else:
            time.sleep(0.2)


def _stop(conns: list[Connection], procs: list, listener: Listener, shm_path: str | None) -> None:
    _unlink(shm_path)
    for conn in conns:
        try:
            conn.send_bytes(_QUIT)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    for p in procs:
        if isinstance(p, subprocess.Popen):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        else:
            try:
                import ray
                ray.kill(p)
            except Exception:   # noqa: BLE001 - Ray already gone
                pass
    for conn in conns:
        conn.close()
    listener.close()


def _unlink(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _ray_node_ip() -> str:
    try:
        import ray
    except ImportError:
        raise KVServeError("distributed_executor_backend 'ray' needs Ray: pip install 'kvserve[ray]'") from None
    return ray.util.get_node_ip_address()


class _RayWorker:
    """A Ray actor running one worker rank (worker_main) until the driver stops it."""

    def run(self, address: tuple[str, int], authkey: bytes, rank: int) -> None:
        worker_main(address, authkey, rank)


def worker_main(address: tuple[str, int], authkey: bytes, rank: int) -> None:
    """A worker rank: connect to the driver, load the shard, bind the KV pools, then run every step the driver
    sends until told to quit."""
    conn = Client(address, authkey=authkey)
    conn.send(rank)
    args: WorkerArgs = conn.recv()
    if args.local_process:
        _die_with_parent(args.driver_pid)
    torch.set_num_threads(args.num_threads)
    try:
        runner, kv_dtype, max_model_len = _load_worker(args)
        conn.send(("loaded",))
        data = conn.recv_bytes()
        if data[:1] == _QUIT:   # the driver failed to start
            return
        _, num_blocks = pickle.loads(data)
        runner.init_kv_cache(dataclasses.replace(args.config, num_kv_blocks=num_blocks), kv_dtype, max_model_len, 0)
        conn.send(("kv",))
        while True:
            data = conn.recv_bytes()
            if data[:1] == _QUIT:
                return
            if data[:1] == _COPY:
                runner.copy_blocks(np.frombuffer(data, np.int64, offset=1).reshape(-1, 2).tolist())
                continue
            runner.execute_step_message(StepMessage.decode(data[1:]))
    except (EOFError, ConnectionError):
        return   # the driver is gone
    except BaseException as e:
        logger.error("kvserve: tensor-parallel rank %d failed:\n%s", args.rank, traceback.format_exc())
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)   # closes the group's sockets: the driver's collective fails at once instead of waiting


def _load_worker(args: WorkerArgs) -> tuple:
    """The rank's shard in a ModelRunner (the model holds the group), its KV pools' dtype, max_model_len."""
    from kvserve.attention import fp8
    from kvserve.model import load_model, resolve_device
    from kvserve.model.loader import model_dtype
    from kvserve.worker.model_runner import ModelRunner
    device = resolve_device(args.config.device)
    if device.type == "cuda":   # mp: one GPU per rank on this machine; Ray shows an actor only the GPU it gave it
        device = torch.device("cuda", args.rank if args.local_process else 0)
        torch.cuda.set_device(device)
    comm = TPComm(args.host, args.store_port, args.rank, args.size, device, shm_path=args.shm_path)
    plans: list[ShardPlan] = []
    model, cfg = load_model(dataclasses.replace(args.config, device=str(device)),
                            shard=lambda c: plans.extend(make_plans(c, args.size)) or plans[args.rank])
    p = plans[args.rank]
    model.set_tensor_parallel(comm, p.vocab[0], p.vocab_per_rank, cfg.vocab_size)
    runner = ModelRunner(model, cfg.vocab_size, device, args.config.seed)
    c = args.config
    if c.enable_lora:   # its adapter slots mirror the driver's (StepMessage.lora_slots)
        from kvserve.lora.manager import LoRAManager
        runner.lora = LoRAManager(model, c.max_loras, c.max_lora_rank, c.max_cpu_loras, p, cfg)
    kv_dtype = fp8.kv_cache_torch_dtype(args.config.kv_cache_dtype, model_dtype(model))
    return runner, kv_dtype, args.config.max_model_len or cfg.max_position_embeddings


def _die_with_parent(driver_pid: int) -> None:
    """Exit when the driver is gone, however it went (reparented: another parent pid; also if that happened
    before this ran). PR_SET_PDEATHSIG would fire when the driver's thread that started this process ends, which
    need not be the driver's end."""
    def watch():
        while os.getppid() == driver_pid:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="kvserve-tp-parent-watch", daemon=True).start()


if __name__ == "__main__":   # a worker process of the "mp" backend (TPExecutor._start_workers)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _host, _port = sys.argv[1].rsplit(":", 1)
    worker_main((_host, int(_port)), bytes.fromhex(os.environ.pop("KVSERVE_TP_AUTHKEY")), int(sys.argv[2]))
