"""KVConnector: moves full KV blocks between an engine's pools and a store other engines share (vLLM V1's
connector, our own code).

    scheduler (KVCacheManager)               runner (ModelRunner)
    get_computed_blocks: pool, host tier,    before the forward: load the step's hits into their fresh blocks
      then connector.lookup -> ConnectorHit  after the forward: a producer saves every prompt finished this step
    allocate_slots: a fresh block per hit

A consumer's lookup continues the pool's run of hits with the blocks the store holds; each hit takes a fresh
block, cached under its hash at once, whose bytes the runner loads before the step's forward, as a host-tier hit
(kvserve/core/host_tier.py). A producer saves, after the forward that finishes a prompt, the prompt's full blocks
the store lacks (blocks the pool had cached too, so a consumer finds the whole prefix).
"""
from __future__ import annotations

import hashlib
import logging
import time

import torch

from kvserve.attention import attention_layers
from kvserve.core.block_pool import BlockHash
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.keys import ConnectorHit, connector_keys
from kvserve.kv_transfer.store import FileStore

logger = logging.getLogger("kvserve")


def engine_fingerprint(models, block_size: int, layout: str) -> bytes:
    """What makes two engines' KV blocks interchangeable: each model's config and a sample of each of its tensors
    (dtype, quantization and weights all show there), every attention layer's K and V pools (dtype, shape), the
    layout their backend writes (`layout`: the attention backend's name) and the block size."""
    h = hashlib.sha256(f"block_size={block_size};layout={layout};".encode())
    for layer in (a for m in models for a in attention_layers(m)):
        for cache in (layer.k_cache, layer.v_cache):
            h.update(f"cache {tuple(cache.shape[1:])} {cache.dtype};".encode())
    for model in models:
        h.update(repr(getattr(model, "config", None)).encode())
        for name, tensor in sorted(model.state_dict().items()):
            h.update(f"{name} {tuple(tensor.shape)} {tensor.dtype};".encode())
            if tensor.device.type != "meta" and tensor.numel() and tensor.element_size():
                sample = tensor.detach().reshape(-1)[:64].contiguous().cpu()
                h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.digest()


class KVConnector:
    """One engine's connector: its role, its store, and the pools (as [blocks, block bytes] uint8 views) it saves
    from and loads into."""

    def __init__(self, config: KVTransferConfig, pools: list[torch.Tensor], fingerprint: bytes):
        self.config = config
        self.pools = pools
        self.row_bytes = [p.shape[1] for p in pools]
        self.block_bytes = sum(self.row_bytes)
        self.root = hashlib.sha256(b"kvserve kv connector v1" + fingerprint).digest()
        self.store = self._make_store()
        self.num_saved = self.num_loaded = 0
        self.transfer_seconds = 0.0
        self.closed = False

    def _make_store(self):
        if self.config.kv_connector == "TcpConnector":
            from kvserve.kv_transfer.tcp import tcp_store
            return tcp_store(self.config, self.block_bytes)
        path = f"{self.config.storage_path}/{self.root.hex()[:16]}"
        return FileStore(path, self.config.kv_buffer_size, self.block_bytes)

    def close(self) -> None:
        """Stop a producer's TCP server (idempotent); a directory store has nothing to close."""
        if hasattr(self.store, "close") and not self.closed:
            self.store.close()
        self.closed = True

    def describe(self) -> str:
        """'SharedStorageConnector (kv_producer) at /dev/shm/kvserve-kv/...'."""
        return f"{self.config.kv_connector} ({self.config.kv_role}) at {self.store.where}"

    # ----- the scheduler's side -----
    def lookup(self, block_hashes: list[BlockHash], start: int) -> list[ConnectorHit]:
        """The store's blocks for block_hashes[start:], up to the first it lacks (none unless a consumer)."""
        if not self.config.is_consumer or start >= len(block_hashes):
            return []
        keys = connector_keys(self.root, block_hashes)[start:]
        found = self.store.find_run(keys)
        return [ConnectorHit(h, k) for h, k in zip(block_hashes[start:], found)]

    # ----- the runner's side -----
    def load(self, loads: list[tuple[ConnectorHit, int]]) -> None:
        """Copy each hit's block from the store into its pool block (before the forward that reads them)."""
        if not loads:
            return
        begin = time.perf_counter()
        buf = torch.empty((len(loads), self.block_bytes), dtype=torch.uint8)
        self.store.read([hit.key for hit, _ in loads], memoryview(buf.numpy().reshape(-1)))
        blocks = torch.tensor([block for _, block in loads])
        offset = 0
        for pool, num_bytes in zip(self.pools, self.row_bytes):
            pool.index_copy_(0, blocks.to(pool.device), buf[:, offset:offset + num_bytes].to(pool.device))
            offset += num_bytes
        self.num_loaded += len(loads)
        self.transfer_seconds += time.perf_counter() - begin

    def save(self, block_hashes: list[BlockHash], block_ids: list[int]) -> int:
        """Keep the blocks (their hashes, their pool blocks) the store lacks; returns how many were saved."""
        if not self.config.is_producer or not block_ids:
            return 0
        begin = time.perf_counter()
        todo = [(key, block) for key, block in zip(connector_keys(self.root, block_hashes), block_ids)
                if not self.store.contains(key)]
        if todo:
            blocks = torch.tensor([block for _, block in todo])
            rows = torch.cat([pool.index_select(0, blocks.to(pool.device)).cpu() for pool in self.pools], dim=1)
            data = rows.numpy()
            for j, (key, _) in enumerate(todo):
                self.store.put(key, memoryview(data[j]))
        self.num_saved += len(todo)
        self.transfer_seconds += time.perf_counter() - begin
        return len(todo)
