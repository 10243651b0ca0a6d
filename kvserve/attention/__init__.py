"""Paged attention: metadata, backends and the Attention module models call.

Tests and warm-up can run a model on one fresh sequence with:
    bind_kv_cache(model, num_blocks=64, block_size=16, dtype=torch.float32)
    hidden = model(input_ids, positions, single_sequence_metadata(len(input_ids), block_size=16))
"""
from kvserve.attention.backends import CpuPagedAttention, TorchPagedAttention, get_backend
from kvserve.attention.layer import (Attention, attention_layers, bind_kv_cache, kv_cache_bytes_per_block,
                                     window_groups)
from kvserve.attention.metadata import (AttentionMetadata, AttnGroup, build_attention_metadata, build_group_metadata,
                                        single_sequence_metadata)

__all__ = ["Attention", "AttentionMetadata", "AttnGroup", "CpuPagedAttention", "TorchPagedAttention",
           "attention_layers", "bind_kv_cache", "build_attention_metadata", "build_group_metadata", "get_backend",
           "kv_cache_bytes_per_block", "window_groups",
           "single_sequence_metadata"]
