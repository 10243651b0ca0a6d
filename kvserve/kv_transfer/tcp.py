"""TcpConnector's store: a producer keeps its blocks in memory (least recently used out past kv_buffer_size) and
serves them over TCP; a consumer, on this machine or another, asks it for them.

    request:  op (1 byte: F find, R read) | n (u32) | n keys (32 bytes each)
    F reply:  u32: how many of the leading keys the producer holds (they become its most recently used)
    R reply:  per key: u8 1 and the block's bytes, or u8 0 (the producer no longer holds it)

A consumer that cannot reach its producer finds nothing and recomputes (logged); a block found then lost before
the step reads it fails that step's requests (KVTransferError), never the engine.
"""
from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
import time
from collections import OrderedDict

from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.store import KVTransferError

logger = logging.getLogger("kvserve")
KEY_BYTES = 32
CONNECT_TIMEOUT_S = 1.0   # a lookup runs on the scheduler's thread: an unreachable producer must cost little
TIMEOUT_S = 30.0
RETRY_AFTER_S = 10.0      # after a failure, lookups find nothing without trying for this long


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)


class MemoryStore:
    """Blocks in memory, least recently used first out past max_bytes; safe to share with the serving threads."""

    def __init__(self, max_bytes: int, block_bytes: int):
        self.max_blocks = max(1, max_bytes // block_bytes)
        self.block_bytes = block_bytes
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self.lock = threading.Lock()
        self.where = "memory"

    def contains(self, key: bytes) -> bool:
        """Whether a block is held under `key`."""
        with self.lock:
            return key in self.blocks

    def find_run(self, keys: list[bytes]) -> list[bytes]:
        """The leading keys held, up to the first that is not (each becomes the most recently used)."""
        with self.lock:
            found = []
            for key in keys:
                if key not in self.blocks:
                    break
                self.blocks.move_to_end(key)
                found.append(key)
            return found

    def get(self, key: bytes) -> bytes | None:
        """A block's bytes, or None."""
        with self.lock:
            return self.blocks.get(key)

    def read(self, keys: list[bytes], out: memoryview) -> None:
        """The blocks' bytes into `out`; KVTransferError for one no longer held."""
        for i, key in enumerate(keys):
            data = self.get(key)
            if data is None:
                raise KVTransferError(f"the KV block {key.hex()} left the producer's buffer before it was read")
            out[i * self.block_bytes:(i + 1) * self.block_bytes] = data

    def put(self, key: bytes, payload: memoryview) -> None:
        """Keep a block, the least recently used leaving past max_bytes."""
        with self.lock:
            if key in self.blocks:
                return
            self.blocks[key] = bytes(payload)
            while len(self.blocks) > self.max_blocks:
                self.blocks.popitem(last=False)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        store: MemoryStore = self.server.store
        sock = self.request
        try:
            while True:
                op, n = struct.unpack("<cI", _recv_exact(sock, 5))
                keys = [_recv_exact(sock, KEY_BYTES) for _ in range(n)]
                if op == b"F":
                    sock.sendall(struct.pack("<I", len(store.find_run(keys))))
                elif op == b"R":
                    for key in keys:
                        data = store.get(key)
                        sock.sendall(b"\x01" + data if data is not None else b"\x00")
                else:
                    return
        except (ConnectionError, OSError):
            return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class ServedStore(MemoryStore):
    """A producer's MemoryStore, served to consumers at (host, port) by a background thread."""

    def __init__(self, max_bytes: int, block_bytes: int, address: tuple[str, int]):
        super().__init__(max_bytes, block_bytes)
        try:
            self.server = _Server(address, _Handler)
        except OSError as e:
            raise KVTransferError(f"TcpConnector cannot listen on {address[0]}:{address[1]}: {e}") from None
        self.server.store = self
        self.where = f"tcp://{address[0]}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="kvserve-kv-server", daemon=True).start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self.server.shutdown()
        self.server.server_close()


class RemoteStore:
    """A consumer's view of a producer's ServedStore: one connection, opened again after a failure."""

    def __init__(self, address: tuple[str, int], block_bytes: int):
        self.address = address
        self.block_bytes = block_bytes
        self.where = f"tcp://{address[0]}:{address[1]}"
        self.sock: socket.socket | None = None
        self._unreachable_logged = False
        self._retry_at = 0.0

    def _request(self, op: bytes, keys: list[bytes]) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
            self.sock.settimeout(TIMEOUT_S)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<cI", op, len(keys)) + b"".join(keys))
        return self.sock

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def contains(self, key: bytes) -> bool:
        """Nothing: a consumer saves nothing."""
        return False

    def put(self, key: bytes, payload: memoryview) -> None:
        """Refused: a consumer holds no store."""
        raise KVTransferError("a TcpConnector consumer holds no store to save into")

    def find_run(self, keys: list[bytes]) -> list[bytes]:
        """The leading keys the producer holds; none while it cannot be reached (retried every RETRY_AFTER_S)."""
        if time.monotonic() < self._retry_at:
            return []
        try:
            (count,) = struct.unpack("<I", _recv_exact(self._request(b"F", keys), 4))
        except OSError as e:   # ConnectionError and timeouts too: found nothing, the prompt is computed
            self._drop()
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            if not self._unreachable_logged:
                logger.warning("kvserve: TcpConnector: the producer at %s cannot be reached (%s); prompts are "
                               "computed here until it can", self.where, e)
                self._unreachable_logged = True
            return []
        self._unreachable_logged = False
        return keys[:count]

    def read(self, keys: list[bytes], out: memoryview) -> None:
        """The blocks' bytes from the producer into `out`; KVTransferError if it no longer has one or fails."""
        try:
            sock = self._request(b"R", keys)
            for i, key in enumerate(keys):
                if _recv_exact(sock, 1) != b"\x01":
                    raise KVTransferError(f"the KV block {key.hex()} left the producer's buffer at {self.where} "
                                          "before it was read")
                out[i * self.block_bytes:(i + 1) * self.block_bytes] = _recv_exact(sock, self.block_bytes)
        except OSError as e:
            self._drop()
            raise KVTransferError(f"reading KV blocks from the producer at {self.where} failed: {e}") from None
        except KVTransferError:
            self._drop()   # the rest of the reply is unread
            raise


def tcp_store(config: KVTransferConfig, block_bytes: int):
    """A producer (or kv_both) serves its own store; a consumer reads its producer's."""
    if config.is_producer:
        return ServedStore(config.kv_buffer_size, block_bytes, config.address)
    return RemoteStore(config.address, block_bytes)
