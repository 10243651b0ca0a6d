"""The tensor-parallel group's collectives: gloo on the CPU, NCCL on CUDA, on a process group of the engine's own
(not torch.distributed's global one, so that one process may hold several engines one after another); all-reduces
of ranks on one machine through shared memory (kvserve/csrc/shm.cpp), which a gloo all-reduce over TCP costs
about a hundred times more."""
from __future__ import annotations

import ctypes
import datetime
import logging
import mmap
import os
import secrets

import torch
import torch.distributed as dist

from kvserve import kernels
from kvserve.errors import EngineDeadError

logger = logging.getLogger("kvserve")

# how long a collective waits for the other ranks: only ever inside a step, where every rank is working
COLLECTIVE_TIMEOUT_S = float(os.environ.get("KVSERVE_TP_TIMEOUT_S", "300"))

# the fused C++ layer stack's all-reduce hook: (bf16 data, number of values)
ALL_REDUCE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)


# shared-memory all-reduce (kvserve/csrc/shm.cpp): its header, and the bytes of one chunk per rank and buffer
SHM_HEADER = 64 * 64
SHM_CHUNK_BYTES = 4 << 20
SHM_MAX_RANKS = 62   # csrc/shm.cpp's header
_SHM_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def create_shm_segment(size: int) -> str | None:
    """The driver's shared-memory segment for a group of `size` ranks on this machine (a file under /dev/shm,
    unlinked once every rank mapped it), or None where there is no /dev/shm or no C++ kernels."""
    why = ("no /dev/shm" if not os.path.isdir("/dev/shm") else "no C++ kernels" if kernels.load() is None else
           f"more than {SHM_MAX_RANKS} ranks" if size > SHM_MAX_RANKS else None)
    if why is not None:
        logger.warning("kvserve: the tensor-parallel ranks all-reduce through gloo (%s)", why)
        return None
    path = f"/dev/shm/kvserve-tp-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:   # reserved now: a full /dev/shm (64 MiB in a default container) fails here, not with SIGBUS mid-step
        os.posix_fallocate(fd, 0, SHM_HEADER + 2 * size * SHM_CHUNK_BYTES)
    except OSError as e:
        logger.warning("kvserve: no room for the tensor-parallel shared-memory segment in /dev/shm (%s); the ranks "
                       "all-reduce through gloo", e)
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


class _ShmSegment:
    def __init__(self, path: str):
        with open(path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), 0)
        self.view = (ctypes.c_char * len(self.map)).from_buffer(self.map)
        self.base = ctypes.addressof(self.view)
        self.seq = ctypes.c_int64(0)   # this rank's chunks so far
        self.seq_ptr = ctypes.addressof(self.seq)


class TPComm:
    """Rank `rank` of `size` in a tensor-parallel group. All-reduces of float32 and bf16 CPU tensors go through
    shared memory where the ranks share a machine (shm_path), the rest through gloo. A failed collective (a rank
    died) raises EngineDeadError, and every later one at once."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: torch.device, store=None,
                 shm_path: str | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.shm = _ShmSegment(shm_path) if shm_path is not None and device.type == "cpu" else None
        self.lib = kernels.load() if self.shm is not None else None
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        # rank 0 made the store (it listens); the others connect to it
        self.store = store if store is not None else dist.TCPStore(host, port, size, False, timeout=timeout)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(self.store, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, size, timeout)
        self.error: str | None = None
        # kept alive as long as the group: the fused stack holds its address
        self.c_all_reduce = ALL_REDUCE_FN(self._all_reduce_from_c)
        self.c_all_reduce_ptr = ctypes.cast(self.c_all_reduce, ctypes.c_void_p).value

    @staticmethod
    def make_store(host: str, size: int):
        """Rank 0's store, on a free port (store.port)."""
        return dist.TCPStore(host, 0, size, True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""
        dtype = _SHM_DTYPES.get(t.dtype) if self.shm is not None and t.is_contiguous() else None
        if dtype is None:
            self._run(lambda: self.group.allreduce([t]))
            return
        self.raise_if_failed()
        rc = self.lib.kvserve_shm_all_reduce(self.shm.base, self.rank, self.size, SHM_CHUNK_BYTES, self.shm.seq_ptr,
                                             t.data_ptr(), t.numel(), dtype, COLLECTIVE_TIMEOUT_S)
        if rc:
            self.error = "a rank died" if rc == 1 else f"no answer within {COLLECTIVE_TIMEOUT_S:.0f} s"
            self.abort()   # the ranks that did arrive stop waiting too
            raise EngineDeadError(f"a tensor-parallel rank stopped answering: {self.error}")

    def abort(self) -> None:
        """Wake every rank waiting in a shared-memory all-reduce with an error (a rank died)."""
        if self.shm is not None:
            self.lib.kvserve_shm_abort(self.shm.base)

    def gather_columns(self, t: torch.Tensor, per_rank: int, total: int) -> torch.Tensor | None:
        """Rank 0: the ranks' [rows, <= per_rank] slices side by side, [rows, total]; other ranks: None."""
        if t.shape[1] < per_rank:   # the last rank's vocabulary slice may be short
            t = torch.nn.functional.pad(t, (0, per_rank - t.shape[1]))
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self._run(lambda: self.group.gather([], [t], opts))
            return None
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run(lambda: self.group.gather([parts], [t], opts))
        return torch.cat(parts, dim=1)[:, :total]

    def _run(self, start) -> None:
        self.raise_if_failed()
        try:
            start().wait()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            raise EngineDeadError(f"a tensor-parallel rank stopped answering: {self.error}") from e

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"a tensor-parallel rank stopped answering: {self.error}")

    def _all_reduce_from_c(self, ptr: int, numel: int) -> None:
        # an exception cannot cross ctypes: it is kept, and FusedLayers.forward raises it after the call
        if self.error is not None:
            return
        try:
            self.all_reduce(torch.frombuffer((ctypes.c_uint16 * numel).from_address(ptr), dtype=torch.bfloat16))
        except Exception as e:   # noqa: BLE001 - recorded in self.error (EngineDeadError) or here
            if self.error is None:
                self.error = f"{type(e).__name__}: {e}"
