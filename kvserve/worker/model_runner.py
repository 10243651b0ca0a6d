"""ModelRunner: the device side of the engine. It sizes and binds the KV cache, turns a SchedulerOutput into one
flattened forward pass and samples the next tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention import (attention_layers, bind_kv_cache, build_attention_metadata, kv_cache_bytes_per_block,
                               single_sequence_metadata)
from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.errors import InvalidRequestError
from kvserve.model.layers import release_unpacked_weights
from kvserve.outputs import Logprob
from kvserve.sample import Sampler, SamplingMetadata, SamplingRow, compute_prompt_logprobs


@dataclass
class StepInputs:
    """Host-side inputs of one step, built with numpy."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: object
    sample_reqs: list[Request]        # requests whose step reaches the end of their tokens
    sample_rows: np.ndarray           # flattened row of each sampling request's last token
    prompt_lp: list[tuple[Request, int, int, int]]   # (req, first position, its row, count) for prompt logprobs


DEFAULT_CPU_KV_BYTES = 1 << 30


class ModelRunner:
    """Runs the model for scheduled requests and samples one token for each that reached its end."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, device: torch.device, seed: int = 0):
        self.model = model
        self.kv: KVCacheManager | None = None   # set by init_kv_cache()
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        # requests without a seed of their own draw from this one: the same seed and requests, the same outputs
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.released_weight_bytes = 0
        if device.type == "cpu" and hasattr(model, "prepack"):
            model.prepack()   # bf16 weights packed for the C++ matmul kernels (or oneDNN): kvserve/csrc/gemv.cpp
            # serving reads only the packs: their plain copies would hold the weights' size again in memory
            self.released_weight_bytes = release_unpacked_weights(model)
        self.small_step_threads: int | None = None   # set by reserve_frontend_core(), with _all_threads

    # ----- the KV cache: the runner owns all device memory -----
    def init_kv_cache(self, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
                      max_num_batched_tokens: int) -> KVCacheManager:
        """Size the KV cache (on CUDA after profiling a full step), bind the model's pools, return their manager."""
        num_blocks = self._num_kv_blocks(config, dtype, max_model_len, max_num_batched_tokens)
        bind_kv_cache(self.model, num_blocks, config.block_size, dtype, self.device)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        return self.kv

    def _num_kv_blocks(self, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
                       max_num_batched_tokens: int) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(self.model, config.block_size, dtype)
        budget = config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            budget = self._profile_cuda_budget(config, dtype, min(max_num_batched_tokens, max_model_len))
        if budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        num = budget // per_block
        if num < 1:
            raise InvalidRequestError(f"kv_cache_memory {budget} bytes is less than one KV block ({per_block} bytes)",
                                      "kv_cache_memory")
        # no point holding more blocks than max_num_seqs full-length sequences can use
        return int(min(num, cdiv(max_model_len, config.block_size) * config.max_num_seqs))

    def _profile_cuda_budget(self, config: EngineConfig, dtype: torch.dtype, num_tokens: int) -> int:
        """Run one forward over a full token budget, then give the KV cache what utilization leaves."""
        bs = config.block_size
        bind_kv_cache(self.model, cdiv(num_tokens, bs), bs, dtype, self.device)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device),
                                single_sequence_metadata(num_tokens, bs, self.device))
            self.model.compute_logits(hidden[-config.max_num_seqs:])
        torch.cuda.synchronize(self.device)
        bind_kv_cache(self.model, 0, bs, dtype, self.device)   # drop the profiling cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak_activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        return int(total * config.gpu_memory_utilization - (total - free) - peak_activations)

    # ----- steps -----
    SMALL_STEP_TOKENS = 4

    def reserve_frontend_core(self) -> None:
        """Run steps of at most SMALL_STEP_TOKENS tokens on one CPU thread fewer (call from the thread that steps).

        Such steps are bound by memory bandwidth, which one core fewer nearly saturates; the core it frees
        serves the HTTP frontend, which otherwise preempts a compute thread while the others wait for it
        (docs/benchmarks.md measures single-stream TPOT through the server both ways)."""
        self._all_threads = torch.get_num_threads()
        if self.device.type == "cpu" and self._all_threads > 1:
            self.small_step_threads = self._all_threads - 1

    def _set_threads(self, num_tokens: int) -> None:
        if self.small_step_threads is None:
            return
        want = self.small_step_threads if num_tokens <= self.SMALL_STEP_TOKENS else self._all_threads
        if want != torch.get_num_threads():
            torch.set_num_threads(want)

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        query_lens, seq_lens, tables, ids, pos = [], [], [], [], []
        sample_reqs, sample_rows, prompt_lp = [], [], []
        row = 0
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start:start + n])
            pos.append(np.arange(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(self.kv.get_block_ids(req.request_id))
            if start + n == req.num_tokens:
                sample_reqs.append(req)
                sample_rows.append(row + n - 1)
            if req.params.prompt_logprobs is not None:
                # row r predicts token r + 1; targets are prompt positions not yet scored, up to the last prompt token
                first = max(start, req.num_prompt_logprobs_done)
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > first:
                    prompt_lp.append((req, first, row + first - start, last - first))
            row += n
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.kv.block_size, self.device)
        to = lambda a: torch.as_tensor(a, dtype=torch.long).to(self.device)
        return StepInputs(to(ids), to(np.concatenate(pos)), meta, sample_reqs, np.asarray(sample_rows, np.int64),
                          prompt_lp)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> dict[str, int]:
        """One forward over every scheduled token; returns request id -> sampled token id."""
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        self._set_threads(sched.num_batched_tokens)
        inp = self.prepare_inputs(sched)
        hidden = self.model(inp.input_ids, inp.positions, inp.attn_metadata)
        if inp.prompt_lp:
            self._prompt_logprobs(hidden, inp)
        if not inp.sample_reqs:
            return {}
        logits = self.model.compute_logits(hidden[torch.as_tensor(inp.sample_rows, device=hidden.device)])
        rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.generator, r.eos_token_ids)
                for r in inp.sample_reqs]
        out = self.sampler(logits, SamplingMetadata.build(rows, self.vocab_size, self.device, self.generator))
        tokens = out.sampled_token_ids.tolist()
        if out.logprobs is not None:
            self._record_logprobs(inp.sample_reqs, out.logprobs)
        return {r.request_id: t for r, t in zip(inp.sample_reqs, tokens)}

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks into the fresh ones before they are written."""
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for layer in attention_layers(self.model):
            for cache in (layer.k_cache, layer.v_cache):
                cache.index_copy_(0, dst, cache.index_select(0, src))

    def _record_logprobs(self, reqs: list[Request], lp) -> None:
        ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        for i, req in enumerate(reqs):
            k = req.params.logprobs
            if k is None:
                continue
            req.logprobs.append(_logprob_dict(ids[i], vals[i], ranks[i], k))
            req.cumulative_logprob += vals[i][0]

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: StepInputs) -> None:
        for req, first, first_row, count in inp.prompt_lp:
            k = req.params.prompt_logprobs
            if first == 0:
                req.prompt_logprobs = [None]   # the first prompt token has no logprob
            logits = self.model.compute_logits(hidden[first_row:first_row + count])
            targets = torch.as_tensor(req.prompt_token_ids[first + 1:first + 1 + count], device=logits.device)
            lp = compute_prompt_logprobs(logits, targets, k)
            ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
            req.prompt_logprobs.extend(_logprob_dict(ids[j], vals[j], ranks[j], k) for j in range(count))
            req.num_prompt_logprobs_done = first + count


def _logprob_dict(ids: list[int], vals: list[float], rank: int, k: int) -> dict[int, Logprob]:
    """Column 0 is the chosen token, columns 1..k the top-k (the chosen one may repeat among them)."""
    d = {ids[0]: Logprob(vals[0], rank)}
    for j in range(1, k + 1):
        d.setdefault(ids[j], Logprob(vals[j], j))
    return d
