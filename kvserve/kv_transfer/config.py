"""KVTransferConfig: which KV connector an engine uses and in which role (vLLM's `kv_transfer_config` shape).

    {"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
     "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/kvserve-kv"}}

A producer saves the KV of every prompt it computes; a consumer loads, instead of computing, the prompt blocks it
finds; kv_both does both. Connectors: SharedStorageConnector (a directory: /dev/shm between processes of one
machine, or a disk), TcpConnector (a producer serves its blocks over TCP to consumers on other machines).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError
from kvserve.json_options import json_object

PARAM = "kv_transfer_config"
CONNECTORS = ("SharedStorageConnector", "TcpConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_BUFFER_BYTES = 4 << 30
_EXTRA_KEYS = {"SharedStorageConnector": {"shared_storage_path"}, "TcpConnector": {"host", "port"}}


def default_storage_path() -> str:
    """/dev/shm/kvserve-kv where /dev/shm exists (memory shared by the processes of this machine), else a
    directory under the system's temporary directory."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "kvserve-kv")


@dataclass
class KVTransferConfig:
    """A KV connector and its role; build with `KVTransferConfig.parse(dict | JSON text | None)`."""

    kv_connector: str
    kv_role: str = "kv_both"
    # the store's size in bytes (SharedStorageConnector: the directory; TcpConnector: the producer's buffer);
    # least recently used blocks leave first
    kv_buffer_size: int | float = DEFAULT_BUFFER_BYTES
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def storage_path(self) -> str:
        return self.kv_connector_extra_config.get("shared_storage_path") or default_storage_path()

    @property
    def address(self) -> tuple[str, int]:
        extra = self.kv_connector_extra_config
        return extra.get("host", "127.0.0.1"), int(extra.get("port", 0))

    @classmethod
    def parse(cls, value) -> KVTransferConfig | None:
        """From a dict, a JSON object text or a KVTransferConfig; None stays None (no connector)."""
        if value is None or isinstance(value, cls):
            if value is not None:
                value.validate()
            return value
        value = json_object(value, cls, PARAM)
        if "kv_connector" not in value:
            raise InvalidRequestError(f"kv_transfer_config needs kv_connector ({', '.join(CONNECTORS)})", PARAM)
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        def bad(message: str):
            raise InvalidRequestError(f"kv_transfer_config: {message}", PARAM)
        if self.kv_connector not in CONNECTORS:
            bad(f"kv_connector must be one of {', '.join(CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            bad(f"kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        size = self.kv_buffer_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
            bad(f"kv_buffer_size must be a positive number of bytes, got {size!r}")
        self.kv_buffer_size = int(size)
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            bad(f"kv_connector_extra_config must be an object, got {type(extra).__name__}")
        unknown = sorted(set(extra) - _EXTRA_KEYS[self.kv_connector])
        if unknown:
            bad(f"unknown kv_connector_extra_config key(s) {unknown} for {self.kv_connector}; known: "
                f"{sorted(_EXTRA_KEYS[self.kv_connector])}")
        if self.kv_connector == "TcpConnector":
            port = extra.get("port")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                bad(f"TcpConnector needs kv_connector_extra_config.port, a TCP port (1-65535), got {port!r}")
