"""Block stores of the KV connectors: the bytes of full KV blocks kept under their connector key
(kvserve/kv_transfer/connector.py says how keys are made). A store entry is a header (magic, key, payload size)
and the block's bytes in every pool of the engine, in pool order.

FileStore keeps one file per block in a directory. In /dev/shm (the default) that is memory shared by every
process of the machine: a prefill instance writes, a decode instance on the same machine reads. On a disk it is a
tier that outlives the process. Files are written under a temporary name and renamed, so a reader never sees half
a block; least recently used files leave when the directory outgrows its size, never one used in the last
GRACE_S seconds (a lookup's block is still to be read by the step that follows it): kv_buffer_size is a target,
not a bound, while the store fills faster than blocks age.
"""
from __future__ import annotations

import logging
import os
import struct
import time
import uuid

from kvserve.errors import KVServeError

logger = logging.getLogger("kvserve")
MAGIC = b"KVSVBLK1"
HEADER = struct.Struct("<8s32sQ")   # magic, key, payload bytes
GRACE_S = 60.0


class KVTransferError(KVServeError):
    """A KV block a connector found could not be read back (a store that lost it, a truncated file)."""


def encode_header(key: bytes, num_bytes: int) -> bytes:
    """A stored block's header: the magic, its key and its payload's size."""
    return HEADER.pack(MAGIC, key, num_bytes)


def check_header(data: bytes, key: bytes, num_bytes: int) -> bool:
    """Whether a stored header is this key's, with a payload of the expected size."""
    if len(data) != HEADER.size:
        return False
    magic, stored_key, stored_bytes = HEADER.unpack(data)
    return magic == MAGIC and stored_key == key and stored_bytes == num_bytes


class FileStore:
    """Blocks as files `<key hex>.kv` in `root`, at most about `max_bytes` of them."""

    def __init__(self, root: str, max_bytes: int, block_bytes: int):
        self.root = self.where = root
        self.max_bytes = max_bytes
        self.block_bytes = block_bytes
        os.makedirs(root, exist_ok=True)
        self._written_since_scan = 0

    def _path(self, key: bytes) -> str:
        return os.path.join(self.root, key.hex() + ".kv")

    def contains(self, key: bytes) -> bool:
        """Whether a block is stored under `key`."""
        return os.path.exists(self._path(key))

    def find_run(self, keys: list[bytes]) -> list[bytes]:
        """The leading keys whose blocks are stored whole, up to the first that is not (any error is a miss). Each
        found block becomes the most recently used, so eviction leaves it for GRACE_S seconds: the step that
        reads it comes long before."""
        found = []
        for key in keys:
            path = self._path(key)
            try:
                if os.stat(path).st_size != HEADER.size + self.block_bytes:
                    break
                os.utime(path)
            except OSError:
                break
            found.append(key)
        return found

    def read(self, keys: list[bytes], out: memoryview) -> None:
        """The blocks' payloads into `out` (block i at i * block_bytes); KVTransferError if one cannot be read."""
        for i, key in enumerate(keys):
            view = out[i * self.block_bytes:(i + 1) * self.block_bytes]
            try:
                with open(self._path(key), "rb", buffering=0) as f:
                    ok = check_header(f.read(HEADER.size), key, self.block_bytes) and \
                        f.readinto(view) == self.block_bytes
            except OSError as e:
                raise KVTransferError(f"the KV block {key.hex()} in {self.root} could not be read: {e}") from None
            if not ok:
                raise KVTransferError(f"the KV block {key.hex()} in {self.root} is truncated or not this block")

    def put(self, key: bytes, payload: memoryview) -> None:
        """Keep one block's payload under `key` (a key already there is left as it is: the same tokens, the same
        bytes). Written under a unique temporary name, then renamed: a reader never sees half a block."""
        path = self._path(key)
        if os.path.exists(path):
            return
        tmp = os.path.join(self.root, f".tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(encode_header(key, len(payload)))
                f.write(payload)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self._written_since_scan += HEADER.size + len(payload)
        if self._written_since_scan > self.max_bytes // 10:
            self.evict()

    def evict(self) -> int:
        """Remove least recently used blocks until the directory holds at most 90% of max_bytes (blocks used in the
        last GRACE_S seconds stay, said in the log when that keeps it over); returns how many were removed."""
        self._written_since_scan = 0
        entries = []
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.name.endswith(".kv"):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    entries.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return 0
        removed, limit, now = 0, self.max_bytes * 9 // 10, time.time()
        for mtime, size, path in sorted(entries):
            if total <= limit:
                break
            if mtime > now - GRACE_S:
                logger.warning("kvserve: KV store %s holds %d bytes, over its %d, all used in the last %.0f s",
                               self.root, total, self.max_bytes, GRACE_S)
                break
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            total -= size
            removed += 1
        return removed
