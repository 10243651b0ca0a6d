"""Beyond one process: tensor parallelism (executor.py, plan.py, comm.py, message.py) and data-parallel replicas
on Ray (replicas.py)."""
from __future__ import annotations

import os

import torch

from kvserve.distributed.plan import check_world, make_plans
from kvserve.errors import InvalidRequestError


def start_tensor_parallel(config, device: torch.device):
    """Check that the model splits over config.tensor_parallel_size ranks, give this process its share of the
    cores, and start the other ranks (TPExecutor)."""
    from kvserve.distributed.executor import TPExecutor
    from kvserve.model import load_model_config
    size = config.tensor_parallel_size
    backend = config.distributed_executor_backend or "mp"
    make_plans(load_model_config(config), size)   # a model that does not split fails before any process starts
    if device.type == "cuda" and backend == "ray":
        raise InvalidRequestError("tensor parallelism on CUDA runs its ranks as local processes: use "
                                  "distributed_executor_backend mp (Ray would not reserve rank 0's GPU)",
                                  "distributed_executor_backend")
    if device.type == "cuda" and config.kv_cache_memory is None and config.num_kv_blocks is None:
        raise InvalidRequestError("tensor parallelism on CUDA needs kv_cache_memory (--kv-cache-memory): sizing the "
                                  "KV cache by a profiling step is not done across ranks", "kv_cache_memory")
    cores = len(os.sched_getaffinity(0))
    check_world(size, cores, backend)
    threads = config.num_threads or max(1, cores // size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        executor = TPExecutor(config, device, threads)
    except BaseException:
        torch.set_num_threads(previous)
        raise
    executor.previous_num_threads = previous   # given back at shutdown (a later engine of this process gets all)
    return executor
