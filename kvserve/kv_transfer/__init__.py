"""KV transfer between engines: a connector saves the KV of prompts to a shared store and loads it back in another
engine (disaggregated prefill/decode, a shared or on-disk prefix cache). docs/kv_transfer.md."""
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.kv_transfer.store import KVTransferError

__all__ = ["KVTransferConfig", "KVTransferError"]
