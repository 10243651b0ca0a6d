"""The engine's start-up log: one line each for the model loaded, the kernels that run, the weights, LoRA and
speculative decoding, and a warning when the KV cache is shorter than the context."""
from __future__ import annotations

import logging
import time

import torch

from kvserve import kernels
from kvserve.model.moe import describe_moe
from kvserve.model.quantization import describe as describe_weights

logger = logging.getLogger("kvserve")


def log_loaded(engine, config, t0: float) -> None:
    """The start-up lines: what was loaded and how fast, the KV cache, the kernels, weights, LoRA and speculation
    (the engine keeps kernel_summary and weights_summary for the server's ready line)."""
    groups = engine.kv.groups
    kv_size = (f"{engine.num_kv_blocks} blocks x {config.block_size} tokens = {engine.num_kv_pool_tokens} tokens"
               if not groups.has_windows else
               f"{engine.num_kv_blocks} pages of {groups.group_size} layers x {config.block_size} tokens, "
               f"{engine.num_kv_pool_tokens} tokens in the longest sequence")
    dtype = str(engine.dtype).removeprefix("torch.")
    if engine.model.dtype_reason:   # what dtype="auto" picked, and why (load_model)
        dtype += f" [auto: {engine.model.dtype_reason}]"
    logger.info("kvserve: loaded %s (%s, %s%s) in %.1fs; KV cache %s%s",
                config.model or "SmolLM2-135M-Instruct (bundled)", dtype,
                engine.device, engine.parallel_description(), time.perf_counter() - t0, kv_size,
                engine.kv_cache_description())
    engine.kernel_summary = kernels.summary(engine.dtype, engine.device, engine.kv_cache_dtype)
    if engine.is_encoder:   # no paged attention: each sequence attends to itself whole
        engine.kernel_summary = ("an encoder: torch matmuls and scaled_dot_product_attention over each step's "
                                 "whole sequences, no KV cache")
    if engine.device.type != "cpu" or config.attention_backend != "auto":
        engine.kernel_summary += f"; attention backend: {engine.runner.attention_backend.name}"
    decoder = getattr(engine.model, "model", None)
    if engine.device.type == "cpu" and engine.dtype == torch.bfloat16 and hasattr(decoder, "fused_status"):
        engine.kernel_summary += f"; decoder layers: {decoder.fused_status()}"
        if decoder.moe_status():
            engine.kernel_summary += f"; MoE blocks: {decoder.moe_status()}"
    if hasattr(decoder, "spec"):
        logger.info("kvserve: %s: %s", engine.model_config.architecture, decoder.spec.describe())
    engine.weights_summary = describe_weights(engine.model)
    experts = describe_moe(engine.model)
    if experts:   # the ready line shows the summary too
        engine.weights_summary += f"; {experts}"
    logger.info("kvserve: weights: %s", engine.weights_summary)
    # a path the machine rules out (no compiler, no packed bf16 matmuls) is a warning: users otherwise never know
    log = logger.warning if kernels.is_degraded(engine.device) else logger.info
    log("kvserve: kernels: %s", engine.kernel_summary)
    if engine.lora is not None:
        logger.info("kvserve: LoRA: %s", engine.lora_description())
    if engine.spec_config:
        logger.info("kvserve: speculative decoding: %s, %d tokens%s, off above %s running requests",
                    engine.spec_config.method, engine.spec_config.num_speculative_tokens,
                    f" from {engine.spec_config.model}" if engine.spec_config.model else "",
                    engine.spec_config.disable_by_batch_size)
    if engine.num_kv_pool_tokens < engine.max_model_len:
        logger.warning("kvserve: the KV cache holds %d tokens, fewer than max_model_len %d: the largest request "
                       "that fits has %d tokens (prompt + output); larger ones are refused. Raise "
                       "kv_cache_memory (--kv-cache-memory) or lower max_model_len (--max-model-len)",
                       engine.num_kv_pool_tokens, engine.max_model_len, engine.num_kv_pool_tokens)
