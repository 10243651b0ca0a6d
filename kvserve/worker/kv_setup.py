"""The model runner's KV cache set-up: the pools' size (a memory budget, on CUDA what a profiled step leaves), the
KV groups of sliding-window layers (kvserve/core/kv_groups.py), the pools bound to the models, and their manager."""
from __future__ import annotations

import logging

import torch

from kvserve.attention import bind_kv_cache, get_backend, kv_cache_bytes_per_block, window_groups
from kvserve.config import EngineConfig
from kvserve.core.host_tier import HostTier
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.kv_groups import KVGroups
from kvserve.errors import InvalidRequestError
from kvserve.kv_transfer.connector import KVConnector, engine_fingerprint
from kvserve.model.moe import moe_layers
from kvserve.worker.cuda_graphs import build_decode_graphs, why_no_graphs
from kvserve.worker.kv_tier import HostTierStorage, kv_pools

logger = logging.getLogger("kvserve")
DEFAULT_CPU_KV_BYTES = 1 << 30


class KVCacheSetup:
    """ModelRunner's KV cache methods (its model, draft_model, models, device, lora and profile_step)."""

    def init_kv_cache(self, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
                      max_num_batched_tokens: int) -> KVCacheManager:
        """Size the KV cache (on CUDA after profiling a full step), bind the model's pools, return their manager.
        dtype: the pools' (the model's, or FP8: kvserve/attention/fp8.py)."""
        self.attention_backend = get_backend(config.attention_backend, self.device)
        self.kv_groups = self._kv_groups()
        num_blocks = self._num_kv_blocks(config, dtype, max_model_len, max_num_batched_tokens)
        for m in self.models:
            bind_kv_cache(m, num_blocks, config.block_size, dtype, self.device, self.attention_backend,
                          calculate_kv_scales=config.calculate_kv_scales,
                          groups=self.kv_groups if m is self.model else None)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, self.kv_groups,
                                 self._host_tier(config), self._kv_connector(config))
        why_not = why_no_graphs(config, self.device, self.attention_backend.name, self.lora is not None,
                                self.kv_groups.num_groups if self.kv_groups is not None else 1,
                                has_moe=bool(moe_layers(self.model)),
                                is_encoder=getattr(self.model, "is_encoder", False))
        if why_not is None:
            self.use_decode_graphs(config.max_num_seqs, max_model_len, config.block_size, capture=True)
        elif self.device.type == "cuda":
            logger.info("kvserve: decode steps run eagerly: %s", why_not)
        return self.kv

    def _host_tier(self, config: EngineConfig) -> HostTier | None:
        """The prefix cache's host tier (kv_offloading_size, preemption_mode swap), its bytes beside the pools."""
        self.tier_storage = None
        size = config.host_tier_bytes
        if not size:
            return None
        if self.kv_groups is not None:
            raise InvalidRequestError("the host KV tier (kv_offloading_size, preemption_mode swap) does not serve "
                                      "models with sliding-window KV groups yet", "kv_offloading_size")
        pools = kv_pools(self.models)
        per_slot = HostTierStorage.bytes_per_slot(pools)
        if size < per_slot:
            raise InvalidRequestError(f"the host KV tier's {size} bytes hold no KV block ({per_slot} bytes)",
                                      "kv_offloading_size")
        self.tier_storage = HostTierStorage(pools, size // per_slot)
        logger.info("kvserve: host KV tier: %d blocks (%.2f GiB): blocks evicted from the pool are kept there by "
                    "hash%s", size // per_slot, size // per_slot * per_slot / 2**30,
                    "; preempted requests' blocks too (preemption_mode swap)" if config.preemption_mode == "swap"
                    else "")
        return HostTier(size // per_slot)

    def _kv_connector(self, config: EngineConfig) -> KVConnector | None:
        """The KV connector of kv_transfer_config (kvserve/kv_transfer), over every pool of the models."""
        self.kv_connector = None
        if config.kv_transfer_config is None:
            return None
        if self.kv_groups is not None:
            raise InvalidRequestError("kv_transfer_config does not serve models with sliding-window KV groups yet",
                                      "kv_transfer_config")
        pools = kv_pools(self.models)
        if not pools:
            raise InvalidRequestError("kv_transfer_config: this model keeps no KV cache (an encoder)",
                                      "kv_transfer_config")
        fingerprint = engine_fingerprint(self.models, config.block_size, self.attention_backend.name)
        self.kv_connector = KVConnector(config.kv_transfer_config, pools, fingerprint)
        role = config.kv_transfer_config
        logger.info("kvserve: KV connector: %s: %s", self.kv_connector.describe(),
                    "; ".join(what for what, on in (("saves the KV of every prompt it computes", role.is_producer),
                                                    ("loads the prompt blocks it finds there", role.is_consumer))
                              if on))
        return self.kv_connector

    def move_tier_blocks(self, msg=None) -> None:
        """The host tier's saves, then the step's copies on write (`msg`'s, taken out of it when there are loads),
        then the tier's and the connector's loads, all queued since the last forward (before the next one writes the
        pools). Saves read evicted blocks before a copy or a load writes them; a copy reads its source before a load
        can write it (a source freed in the same schedule, by a preemption, may be a load's fresh block)."""
        saves, tier_loads = self.kv.take_tier_copies()
        loads = self.kv.take_connector_loads()
        try:
            if msg is None and (tier_loads or loads):   # (the drafts' allocations take no prefix hits: no loads)
                raise RuntimeError("loads queued outside a step: its copies on write would run after them")
            if self.tier_storage is not None:
                self.tier_storage.copy(saves, [])
            if (tier_loads or loads) and msg is not None and len(msg.block_copies):
                self._copy_blocks(msg.block_copies.tolist())
                msg.block_copies = msg.block_copies[:0]   # done: the forward must not copy them again
            if self.tier_storage is not None:
                self.tier_storage.copy([], tier_loads)
            if self.kv_connector is not None:
                self.kv_connector.load(loads)
        except BaseException:   # whatever failed, these blocks' bytes may not be their tokens' KV
            self.kv.forget_blocks([block for _, block in tier_loads] + [block for _, block in loads])
            raise

    def save_to_connector(self, sched) -> None:
        """A producer's saves after the forward: every prompt this step finished, its full blocks the store lacks
        (a failed save is logged: the step's outputs stand, a consumer recomputes what it does not find)."""
        if self.kv_connector is None or not self.kv_connector.config.is_producer:
            return
        for req, n in sched.scheduled:
            if req.num_computed_tokens < req.num_prompt_tokens <= req.num_computed_tokens + n:
                hashes = self.kv.prompt_block_hashes(req)
                try:
                    self.kv_connector.save(hashes, self.kv.get_block_ids(req.request_id)[:len(hashes)])
                except Exception as e:   # noqa: BLE001 - best effort: the step's outputs stand
                    logger.warning("kvserve: KV connector: saving the prompt of request %s failed: %s: %s",
                                   req.request_id, type(e).__name__, e)

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int, block_size: int, capture: bool) -> None:
        """Run decode steps through DecodeGraphs' padded buffers, captured as CUDA graphs where `capture` (the
        CPU tests run the same path eagerly)."""
        self.decode_graphs = build_decode_graphs(self.model, max_num_seqs, max_model_len, block_size, self.device,
                                                 capture)

    def _kv_groups(self) -> KVGroups | None:
        """The target's KV groups where it has sliding-window layers (kvserve/core/kv_groups.py), else None. A draft
        model reads the first group's tables: that group must be a full-attention one."""
        groups = window_groups(self.model)
        if groups is None:
            return None
        if self.draft_model is not None and groups.windows[0] is not None:
            logger.info("kvserve: KV: every layer keeps its whole context: the draft model reads the target's "
                        "block tables, and every layer of the target has a sliding window")
            return None
        logger.info("kvserve: KV: %s; blocks that leave a window go back to the pool",
                    groups.describe())
        return groups

    def _num_kv_blocks(self, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
                       max_num_batched_tokens: int) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = sum(kv_cache_bytes_per_block(m, config.block_size, dtype,
                                                 self.kv_groups if m is self.model else None) for m in self.models)
        budget = config.kv_cache_memory
        if per_block == 0:   # an encoder keeps no KV: its blocks are the scheduler's bookkeeping only
            per_block, budget = 1, 1 << 62
        if budget is None and self.device.type == "cuda":
            budget = self._profile_cuda_budget(config, dtype, min(max_num_batched_tokens, max_model_len))
        if budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        num = budget // per_block
        if num < 1:
            raise InvalidRequestError(f"kv_cache_memory {budget} bytes is less than one KV block ({per_block} bytes)",
                                      "kv_cache_memory")
        # no point holding more blocks than max_num_seqs full-length sequences can use (and the null block)
        groups = self.kv_groups or KVGroups.single(1)
        longest = groups.blocks_needed(max_model_len, max_num_batched_tokens or max_model_len, config.block_size)
        return int(min(num, longest * config.max_num_seqs + groups.has_windows))

    def _profile_cuda_budget(self, config: EngineConfig, dtype: torch.dtype, num_tokens: int) -> int:
        """Run one forward over a full token budget, then give the KV cache what utilization leaves."""
        bs = config.block_size
        bind_kv_cache(self.model, cdiv(num_tokens, bs), bs, dtype, self.device, self.attention_backend)
        # the step's own peak: not the process's since it started (an engine before this one, the caller's tensors)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        sampled = self.profile_step(config, num_tokens)
        torch.cuda.synchronize(self.device)
        peak_activations = torch.cuda.max_memory_allocated(self.device) - before
        bind_kv_cache(self.model, 0, bs, dtype, self.device, self.attention_backend)   # drop the profiling cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * config.gpu_memory_utilization - (total - free) - peak_activations)
        if budget <= 0:
            raise InvalidRequestError(
                f"gpu_memory_utilization {config.gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves nothing "
                f"for the KV cache: {(total - free) / 2**30:.1f} GiB in use (weights), "
                f"{peak_activations / 2**30:.1f} GiB for the largest step (a forward over {num_tokens} tokens, "
                f"then logits and sampling for {sampled} rows); lower max_num_batched_tokens, max_num_seqs or "
                "num_speculative_tokens, raise gpu_memory_utilization, or set kv_cache_memory", "kv_cache_memory")
        return budget
