"""Connector keys: the name a full KV block has in a store that several engines share.

The prefix cache's block hashes are seeded per process (kvserve/core/block_pool.py), so two engines name the same
block differently. A connector key is the same chain without the seed, rooted in the engine's fingerprint (model
config, KV layout, block size, a sample of its weights):

    key[0] = sha256(root, tokens[0], extra keys[0]);  key[i] = sha256(key[i-1], tokens[i], extra keys[i])

so two engines serving the same model with the same settings find each other's blocks, and engines that differ
in anything that changes the KV bytes never do.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from kvserve.core.block_pool import BlockHash


@dataclass(frozen=True)
class ConnectorHit:
    """A prefix-cache hit in the KV connector's store, under `key` (read by the runner's load)."""
    block_hash: BlockHash
    key: bytes


def connector_keys(root: bytes, block_hashes: list[BlockHash]) -> list[bytes]:
    """The connector key of each block of a chain of prefix-cache hashes (the same tokens and extra keys)."""
    keys, parent = [], root
    for block_hash in block_hashes:
        h = hashlib.sha256(parent)
        h.update(np.asarray(block_hash.token_ids, dtype=np.int64).tobytes())
        for key in block_hash.extra_keys:
            h.update(struct.pack("<Q", len(str(key))) + str(key).encode())
        parent = h.digest()
        keys.append(parent)
    return keys
