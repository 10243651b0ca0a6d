"""Decode steps replayed from CUDA graphs: the model's forward over a batch of decodes (one new token per sequence)
captured once per padded batch size at start, then replayed with the step's inputs copied into the same buffers.

    persistent buffers (max size)           one step of n decodes, padded to the captured size B >= n
    input_ids     [B_max]   long            rows n..B-1: token 0, position 0
    positions     [B_max]   long
    slot_mapping  [B_max]   long            rows n..B-1: -1 (the KV write skips them)
    seq_lens      [B_max]   int32           rows n..B-1: 1 (they read one key of block 0; their outputs are dropped)
    block_table   [B_max, max blocks] int32 rows n..B-1: zeros
    query_start_loc [B_max + 1] int32       0, 1, 2, ... : fixed, every row is one token

The attention kernels read lengths and block tables on the device and size their grid from the shapes alone, so a
graph captured at size B replays any n <= B. The host fills a pinned staging copy of the inputs and sends it with
one non-blocking copy per buffer.

On the CPU (tests) the same buffers and padding run eagerly (capture=False): the path the graphs replay is tested
there; only the capture itself needs a GPU. `enforce_eager` (--enforce-eager) turns the graphs off.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvserve.attention.metadata import AttentionMetadata, padded_block_tables
from kvserve.core.kv_cache_manager import cdiv

logger = logging.getLogger("kvserve")
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and max_num_seqs itself), at most 512."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Padded decode batches run through persistent buffers, captured as CUDA graphs where `capture`."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_blocks_per_seq: int, block_size: int,
                 device: torch.device, capture: bool):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.block_size = block_size
        self.device = device
        self.capture = capture
        n, width = self.max_size, max_blocks_per_seq
        pin = device.type == "cuda"
        # staging copies on the host (pinned: the copies to the device do not wait for the host)
        self.ids_cpu = torch.zeros(n, dtype=torch.long, pin_memory=pin)
        self.pos_cpu = torch.zeros(n, dtype=torch.long, pin_memory=pin)
        self.slots_cpu = torch.full((n,), -1, dtype=torch.long, pin_memory=pin)
        self.seq_lens_cpu = torch.ones(n, dtype=torch.int32, pin_memory=pin)
        self.tables_cpu = torch.zeros(n, width, dtype=torch.int32, pin_memory=pin)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        from kvserve.attention import attention_layers
        self.layers = attention_layers(model)
        # FP8 scales calibrate on the first step that runs the modules eagerly: no replay before that
        self.calibration_pending = any(a.calibrate_kv_scales for a in self.layers)
        # the staging copies are rewritten only once the last step's copies from them are done
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.num_runs = 0   # steps run through the buffers (replayed where captured)

    def can_run(self, query_lens, num_blocks) -> bool:
        """Whether a step of these sequences is all decodes within the largest size and the tables' width, once no
        layer waits to calibrate its FP8 scales."""
        if self.calibration_pending:
            self.calibration_pending = any(a.calibrate_kv_scales for a in self.layers)
            if self.calibration_pending:
                return False
        return (0 < len(query_lens) <= self.max_size and bool((np.asarray(query_lens) == 1).all())
                and int(np.max(num_blocks)) <= self.block_table.shape[1])

    def _metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata over the first `size` rows of the buffers (the host-side fields are unused)."""
        ones = np.ones(size, dtype=np.int64)
        return AttentionMetadata(num_tokens=size, slot_mapping=self.slot_mapping[:size], query_lens=ones,
                                 seq_lens=ones, host_tables=np.zeros((size, 1), np.int64), table_lens=ones,
                                 block_size=self.block_size,
                                 query_start_loc=self.query_start_loc[:size + 1], seq_lens_tensor=self.seq_lens[:size],
                                 block_table_tensor=self.block_table[:size], device=self.device)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._metadata(size))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per size, largest first, sharing one memory pool; each after a warm-up run (Triton
        compiles its kernels then: a capture cannot). The padded rows write no KV (slot -1). FP8 scale calibration,
        which the first real step does eagerly, is held off meanwhile."""
        if not self.capture:
            return
        layers = self.layers
        calibrating = [a.calibrate_kv_scales for a in layers]
        for a in layers:
            a.calibrate_kv_scales = False
        t0 = time.perf_counter()
        pool = None
        try:
            for size in reversed(self.sizes):
                self._forward(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
            torch.cuda.synchronize(self.device)
        finally:
            for a, flag in zip(layers, calibrating):
                a.calibrate_kv_scales = flag
        self.capture_seconds = time.perf_counter() - t0
        logger.info("kvserve: CUDA graphs captured for decode batches of %s in %.1fs (--enforce-eager: none)",
                    ", ".join(map(str, self.sizes)), self.capture_seconds)

    def run(self, input_ids, positions, seq_lens, tables: list[list[int]] | np.ndarray, fill=None) -> torch.Tensor:
        """Hidden states [n, hidden] of n decodes (input_ids/positions/seq_lens: host sequences of length n;
        tables: their block tables, or those padded already (pad_tables)). `fill(ids)`: writes the tokens still on
        the device into the ids buffer (async scheduling)."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        if self.copied is not None:
            self.copied.synchronize()
        self.ids_cpu[:n] = torch.as_tensor(input_ids, dtype=torch.long)
        self.pos_cpu[:n] = torch.as_tensor(positions, dtype=torch.long)
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        # [n, the longest table], padded with block 0
        table = tables if isinstance(tables, np.ndarray) else padded_block_tables(tables, 1)
        width = table.shape[1]
        pos = seq_lens - 1
        slots = table[np.arange(n), pos // self.block_size] * self.block_size + pos % self.block_size
        self.slots_cpu[:n] = torch.from_numpy(slots)
        self.seq_lens_cpu[:n] = torch.from_numpy(seq_lens.astype(np.int32))
        self.tables_cpu[:n, :width] = torch.from_numpy(table)
        self.tables_cpu[:n, width:] = 0
        # padding rows n..size-1 keep their staged values: token 0, slot -1, length 1, block 0
        self.ids_cpu[n:size] = 0
        self.pos_cpu[n:size] = 0
        self.slots_cpu[n:size] = -1
        self.seq_lens_cpu[n:size] = 1
        self.tables_cpu[n:size] = 0
        nb = self.device.type == "cuda"
        self.num_runs += 1
        for dst, src in ((self.input_ids, self.ids_cpu), (self.positions, self.pos_cpu),
                         (self.slot_mapping, self.slots_cpu), (self.seq_lens, self.seq_lens_cpu),
                         (self.block_table, self.tables_cpu)):
            dst[:size].copy_(src[:size], non_blocking=nb)
        if self.copied is not None:
            self.copied.record()
        if fill is not None:
            fill(self.input_ids[:n])
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]


def why_no_graphs(config, device: torch.device, attention_backend: str, has_lora: bool,
                  num_kv_groups: int = 1, has_moe: bool = False, is_encoder: bool = False) -> str | None:
    """Why an engine's decode steps cannot replay CUDA graphs (config: its EngineConfig), or None when they can."""
    if device.type != "cuda":
        return "not on CUDA"
    if is_encoder:
        return "an encoder runs whole sequences, never decode steps"
    if config.enforce_eager:
        return "enforce_eager"
    if attention_backend != "triton":
        return f"the {attention_backend} attention backend reads the step's lengths on the host"
    if has_lora:
        return "LoRA adapters change per step"
    if config.tensor_parallel_size > 1:   # every rank: a worker's runner has no executor of its own
        return "tensor parallelism"
    if has_moe:
        return "the mixture-of-experts MLPs count each expert's tokens on the host"
    if num_kv_groups > 1:
        return "the KV groups of sliding-window layers (their block tables) are not in the graphs' buffers"
    return None


def build_decode_graphs(model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                        device: torch.device, capture: bool) -> DecodeGraphs | None:
    """DecodeGraphs for an engine's sizes, captured where `capture`; None, with a warning, if a capture fails."""
    graphs = DecodeGraphs(model, capture_sizes(max_num_seqs), cdiv(max_model_len, block_size), block_size, device,
                          capture)
    try:
        graphs.capture_all()
    except Exception as e:   # a model or kernel a graph cannot hold: said loudly, then served eagerly
        logger.warning("kvserve: CUDA graph capture failed (%s: %s): decode steps run eagerly", type(e).__name__, e)
        return None
    return graphs
