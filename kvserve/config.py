"""EngineConfig: the one configuration object of the engine, validated once."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from kvserve.errors import InvalidRequestError
from kvserve.kv_transfer.config import KVTransferConfig
from kvserve.sampling_params import MAX_SEED, MIN_SEED
from kvserve.spec_decode.config import SpeculativeConfig

QUANTIZATION_CHOICES = ("auto", "gguf", "int8", "none")   # EngineConfig.quantization (kvserve/model/quantization.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")   # EngineConfig.kv_cache_dtype (kvserve/attention/fp8.py)
# EngineConfig.attention_backend (kvserve/attention/backends.py)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(value: int | float | str, param: str = "kv_cache_memory") -> int:
    """Parse a byte size such as 2GiB, 512MiB, 1e9 or 1073741824 into bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(value)
    if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
        raise InvalidRequestError(f"cannot parse the size {value!r} ({param}); use e.g. 2GiB, 512MiB or a byte "
                                  "count", param)
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _gib(value: float | str, param: str) -> int:
    """A size given as GiB (a number, or a string of one: vLLM's unit for these settings) or with its unit
    ("512MiB") -> bytes; -1 for what is no finite size."""
    try:
        gib = float(value)
    except (TypeError, ValueError):
        return parse_size(value, param) if isinstance(value, str) else -1
    return int(gib * 2**30) if math.isfinite(gib) else -1


@dataclass
class EngineConfig:
    """Everything the engine needs to know; fields keep vLLM's names where vLLM has one."""

    model: str | None = None            # HF directory or .gguf file; None = bundled SmolLM2-135M-Instruct
    tokenizer: str | None = None        # defaults to the model's own tokenizer
    dtype: str = "auto"                 # auto | float32 | bfloat16 | float16
    device: str = "auto"                # auto | cpu | cuda
    # auto: triton on CUDA, the C++ kernels on the CPU; torch: the plain-torch reference; cpu: the C++ kernels;
    # triton: the Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1)
    attention_backend: str = "auto"
    # CUDA: decode steps replay CUDA graphs captured at start for padded batch sizes (kvserve/worker/cuda_graphs.py);
    # True runs every step eagerly
    enforce_eager: bool = False
    # schedule and launch each step before the last one's tokens are back (kvserve/worker/step_pipeline.py), so that
    # the host's work overlaps the device's; None: on for CUDA, off on the CPU (the host computes the step itself)
    async_scheduling: bool | None = None
    # auto: a .gguf file's quantized weights stay quantized on the CPU (gguf); int8: W8A8, the linears quantized
    # at load (CPU); none: dequantized to dtype
    quantization: str = "auto"
    seed: int = 0                       # seeds the sampling of requests without their own seed (reproducible runs)
    max_model_len: int | None = None    # defaults to the model's context length
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes or "2GiB"; default: 1 GiB on CPU
    # auto: the model's dtype; fp8 (= fp8_e4m3) | fp8_e5m2: one byte per value (kvserve/attention/fp8.py)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False   # FP8 KV: per-layer scales from the first step's K/V, else 1.0
    gpu_memory_utilization: float = 0.9       # CUDA only, used when kv_cache_memory is not set
    num_kv_blocks: int | None = None    # overrides the memory budget (tests)
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # token budget of a step; default: 1024 on CPU, 8192 on CUDA
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # the prefix cache's second tier in host memory (kvserve/core/host_tier.py), vLLM's names: a number is GiB, a
    # string a size ("512MiB"); 0: none. preemption_mode swap keeps a preempted request's blocks there (sized by
    # swap_space unless kv_offloading_size is set) instead of recomputing them
    kv_offloading_size: float | str = 0
    preemption_mode: str = "recompute"  # recompute | swap
    swap_space: float | str = 4
    # a KV connector (kvserve/kv_transfer), vLLM's shape: a dict or JSON text, e.g. {"kv_connector":
    # "SharedStorageConnector", "kv_role": "kv_producer"}; parsed into a KVTransferConfig; None = none
    kv_transfer_config: dict | str | KVTransferConfig | None = None
    # what the engine serves (vLLM's names): generate, pooling (embeddings only: LLM.embed, /v1/embeddings), or auto
    # (generation, and embeddings too; an encoder such as BERT pools only). task="embed" is pooling
    runner: str = "auto"
    task: str | None = None
    # per-request accounting (kvserve/engine/accounting.py): each output's metrics["accounting"], the server's
    # usage.kvserve_accounting
    enable_request_accounting: bool = False
    scheduling_policy: str = "fcfs"     # fcfs | priority
    priority_aging_s: float = 10.0      # priority policy: seconds of waiting worth one priority level; 0 = no aging
    chat_template: str | None = None    # path or inline Jinja; defaults to the checkpoint's
    num_threads: int | None = None      # CPU threads; default: all cores
    # speculative decoding: a dict or JSON text, e.g. {"method": "ngram", "num_speculative_tokens": 5};
    # parsed into a SpeculativeConfig (kvserve/spec_decode/config.py); None = off
    speculative_config: dict | str | SpeculativeConfig | None = None
    # structured outputs: a request whose grammar has not compiled this long after it arrived fails (400)
    grammar_compile_timeout_s: float = 10.0
    # LoRA adapters (kvserve/lora): requests name one (LoRARequest); max_loras of them run in one step, each of rank
    # <= max_lora_rank; max_cpu_loras stay loaded in memory (default max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # tensor parallelism (kvserve/distributed): the model's heads, MLP and vocabulary split over this many ranks;
    # "mp" starts one worker process per extra rank, "ray" runs them as Ray actors (ray_address: an existing
    # cluster, "auto", or None to start a local Ray instance)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def bad(msg, param):
            raise InvalidRequestError(msg, param)
        for name in ("model", "tokenizer", "chat_template"):   # a pathlib.Path is a path too
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float"):
            bad(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}", "dtype")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
                "attention_backend")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
                "kv_cache_dtype")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            bad("calculate_kv_scales sets the scales of an FP8 KV cache: pass kv_cache_dtype fp8, fp8_e4m3 or "
                f"fp8_e5m2 with it (kv_cache_dtype is {self.kv_cache_dtype!r})", "calculate_kv_scales")
        if self.quantization not in QUANTIZATION_CHOICES:
            bad(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}",
                "quantization")
        if self.block_size < 1 or self.block_size > 1024:
            bad(f"block_size must be in [1, 1024], got {self.block_size}", "block_size")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be >= 1, got {self.max_num_seqs}", "max_num_seqs")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}", "max_num_batched_tokens")
        if not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED:
            bad(f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {self.seed!r}", "seed")
        if not (isinstance(self.priority_aging_s, (int, float)) and 0 <= self.priority_aging_s < float("inf")):
            bad(f"priority_aging_s must be a finite number >= 0, got {self.priority_aging_s!r}", "priority_aging_s")
        if not (isinstance(self.grammar_compile_timeout_s, (int, float)) and 0 < self.grammar_compile_timeout_s
                < float("inf")):
            bad(f"grammar_compile_timeout_s must be a positive number, got {self.grammar_compile_timeout_s!r}",
                "grammar_compile_timeout_s")
        if self.scheduling_policy not in ("fcfs", "priority"):
            bad(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}", "scheduling_policy")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad(f"max_model_len must be >= 1, got {self.max_model_len}", "max_model_len")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}", "num_kv_blocks")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization must be in (0, 1]", "gpu_memory_utilization")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                bad("kv_cache_memory must be positive", "kv_cache_memory")
        if self.task is not None:
            if self.task not in ("generate", "embed"):
                bad(f"task must be generate or embed, got {self.task!r}", "task")
            self.runner = "pooling" if self.task == "embed" else "generate"
        if self.runner not in ("auto", "generate", "pooling"):
            bad(f"runner must be auto, generate or pooling, got {self.runner!r}", "runner")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._validate_offloading(bad)
        self._validate_lora(bad)
        self._validate_parallel(bad)
        if self.async_scheduling and self.speculative_config is not None:
            bad("async_scheduling does not run with speculative decoding (the drafts are proposed from the tokens "
                "just sampled)", "async_scheduling")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            bad("async_scheduling does not run with tensor_parallel_size > 1 yet (each rank's step takes its "
                "input tokens from the driver)", "async_scheduling")
        if (not self.enable_chunked_prefill and self.max_model_len and self.max_num_batched_tokens is not None
                and self.max_model_len > self.max_num_batched_tokens):
            bad("without chunked prefill, max_num_batched_tokens must be >= max_model_len", "max_num_batched_tokens")

    def _validate_offloading(self, bad) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            bad(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}", "preemption_mode")
        for name in ("kv_offloading_size", "swap_space"):
            value = getattr(self, name)
            size = _gib(value, name) if not isinstance(value, bool) else -1
            if size < 0:
                bad(f"{name} must be a size >= 0 (GiB, or e.g. 512MiB), got {value!r}", name)
        if self.host_tier_bytes and not self.enable_prefix_caching:
            bad("the host KV tier (kv_offloading_size, preemption_mode swap) finds blocks by their prefix-cache hash: "
                "it needs enable_prefix_caching", "kv_offloading_size")
        if self.host_tier_bytes and self.tensor_parallel_size > 1:
            bad("the host KV tier (kv_offloading_size, preemption_mode swap) does not run with tensor_parallel_size > 1 "
                "yet", "kv_offloading_size")
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is not None and not self.enable_prefix_caching:
            bad("kv_transfer_config finds and registers blocks by their prefix-cache hash: it needs "
                "enable_prefix_caching", "kv_transfer_config")
        if self.kv_transfer_config is not None and self.tensor_parallel_size > 1:
            bad("kv_transfer_config does not run with tensor_parallel_size > 1 yet", "kv_transfer_config")
        if self.kv_transfer_config is not None and self.enable_lora:
            bad("kv_transfer_config does not run with LoRA adapters yet (an adapter's number differs between "
                "engines)", "kv_transfer_config")
        if self.kv_transfer_config is not None and self.calculate_kv_scales:
            bad("kv_transfer_config does not run with calculate_kv_scales (each engine calibrates its own FP8 "
                "scales)", "kv_transfer_config")

    @property
    def host_tier_bytes(self) -> int:
        """The host tier's size in bytes (kv_offloading_size, else swap_space under preemption_mode swap), 0: none."""
        size = _gib(self.kv_offloading_size, "kv_offloading_size")
        if not size and self.preemption_mode == "swap":
            size = _gib(self.swap_space, "swap_space")
        return max(size, 0)

    def _validate_lora(self, bad) -> None:
        for name, low, high in (("max_loras", 1, 256), ("max_lora_rank", 1, 1024), ("max_cpu_loras", 1, 1 << 20)):
            value = getattr(self, name)
            if value is None and name == "max_cpu_loras":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                bad(f"{name} must be an integer in [{low}, {high}], got {value!r}", name)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            bad(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): every adapter "
                "a step runs is also kept in memory", "max_cpu_loras")

    def _validate_parallel(self, bad) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
                bad(f"{name} must be an integer in [1, 1024], got {value!r}", name)
        if self.pipeline_parallel_size != 1:
            bad("pipeline parallelism is not built (docs/architecture.md describes how it would fit); use "
                "tensor_parallel_size, or data-parallel replicas (kvserve serve --data-parallel-size)",
                "pipeline_parallel_size")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            bad(f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}",
                "distributed_executor_backend")
        if self.tensor_parallel_size == 1:
            return
        if self.calculate_kv_scales:
            bad("calibrated FP8 KV scales do not run with tensor_parallel_size > 1 yet", "calculate_kv_scales")
