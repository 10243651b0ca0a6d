"""LLMEngine: the synchronous engine. add_request() validates and queues; step() runs one iteration."""
from __future__ import annotations

import functools
import itertools
import logging
import os
import time

import torch

from kvserve import kernels
from kvserve.attention import fp8
from kvserve.config import EngineConfig
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.engine.output_processor import OutputProcessor, ParentState
from kvserve.engine.accounting import Accountant, RequestAccounting
from kvserve.engine.beam_group import BeamGroup, beam_request_params
from kvserve.engine.describe import log_loaded
from kvserve.entrypoints.beam_search import BeamSearchParams
from kvserve.engine.step_loop import StepLoop
from kvserve.engine.pooling import check_pooling_fits, pooling_state, refuse_generation
from kvserve.engine.prompts import PromptType, process_prompt
from kvserve.distributed import start_tensor_parallel
from kvserve.errors import ContextLengthExceededError, InvalidRequestError, KVServeError, LoRAError
from kvserve.lora import LoRARequest
from kvserve.lora.manager import LoRAManager
from kvserve.model import load_model, load_tokenizer, resolve_device
from kvserve.model.loader import load_model_config, model_dtype, use_device
from kvserve.model.registry import get_model_class
from kvserve.outputs import RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sample.constraints import bad_words_token_ids, check_allowed_tokens, truncate_prompt
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.draft_loader import load_draft_model
from kvserve.spec_decode.proposer import build_proposer
from kvserve.structured_output import StructuredOutputManager
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.step_pipeline import PendingStep, async_scheduling_choice

logger = logging.getLogger("kvserve")


class LLMEngine(StepLoop):
    """Owns the model, the KV cache, the scheduler and the frontend output processing."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        use_device(self.device)
        t0 = time.perf_counter()
        if config.tensor_parallel_size > 1 or config.enable_lora or config.speculative_config:
            _refuse_for_encoders(config)
        self.executor = start_tensor_parallel(config, self.device) if config.tensor_parallel_size > 1 else None
        # the engine thread's OpenMP thread count (per OS thread): config.num_threads, or each rank's share
        self.num_threads = torch.get_num_threads() if self.executor is not None else config.num_threads
        try:
            self._init(config, t0)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, config: EngineConfig, t0: float) -> None:
        # the tokenizer first: parsing a large tokenizer.json peaks at a few hundred MB that are handed back before
        # the weights arrive (release_build_state), so the process's peak is not the two together
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        if self.executor is None:
            self.model, self.model_config = load_model(config)
        else:   # this process is rank 0: it loads shard 0 while the workers load theirs
            self.model, self.model_config = load_model(config, shard=self.executor.plan)
            self.executor.attach(self.model, self.model_config.vocab_size)
            self.executor.wait_ready("loaded")
        if config.chat_template:
            self.tokenizer.chat_template = _read_template(config.chat_template)
        self.dtype = model_dtype(self.model)
        self.vocab_size = self.model_config.vocab_size
        self.is_encoder = getattr(self.model, "is_encoder", False)   # embeds only (kvserve/model/bert.py)
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.block_size = config.block_size
        self.max_num_batched_tokens = self._max_num_batched_tokens()
        self.spec_config = config.speculative_config
        draft_model = load_draft_model(self) if self.spec_config and self.spec_config.model else None
        self.runner = ModelRunner(self.model, self.vocab_size, self.device, config.seed, draft_model)
        shard = self.executor.plans[0] if self.executor is not None else None   # tensor parallel: rank 0's part
        self.lora = (LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, shard,
                                 self.model_config) if config.enable_lora else None)
        self.runner.lora = self.lora
        self.runner.executor = self.executor
        self.kv_cache_dtype = fp8.kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.kv = self.runner.init_kv_cache(config, self.kv_cache_dtype, self.max_model_len,
                                            self.max_num_batched_tokens)
        self.num_kv_blocks = self.kv.pool.num_blocks   # the tensor-parallel ranks' pools: the null block too
        if self.executor is not None:
            self.executor.init_kv_cache(self.num_kv_blocks)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                                   config.scheduling_policy, config.enable_chunked_prefill, config.priority_aging_s,
                                   config.max_loras if self.lora else None,
                                   (lambda req: self.lora.is_ready(req.lora_request)) if self.lora else None)
        self.proposer = build_proposer(self.spec_config, self.runner) if self.spec_config else None
        self.scheduler.on_finished = self._on_request_finished
        self.processor = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                                         config.grammar_compile_timeout_s)
        self._ids = itertools.count()
        self.accountant = Accountant() if config.enable_request_accounting else None
        self.async_scheduling, why = async_scheduling_choice(config, self.device, self.executor is not None)
        self._pending: PendingStep | None = None   # async scheduling: the step launched and not yet merged
        self._failed: dict[str, KVServeError] = {}   # parent request id -> why it failed, until taken
        log_loaded(self, config, t0)
        logger.info("kvserve: async scheduling %s (%s)", "on" if self.async_scheduling else "off", why)
        # the loading thread's OpenMP workers: the server steps on another thread (a Ray replica's too), whose
        # parallel regions they would slow; offline, the next step starts them again
        kernels.release_openmp_workers()

    def kv_cache_description(self) -> str:
        """' in fp8_e4m3 (scales 1.0)' for an FP8 KV cache, else ''."""
        if not fp8.is_fp8(self.kv_cache_dtype):
            return ""
        name = str(self.kv_cache_dtype).removeprefix("torch.float8_").removesuffix("fn")
        scales = "calibrated on the first step" if self.config.calculate_kv_scales else "1.0"
        return f" in fp8_{name} (scales {scales})"

    def parallel_description(self) -> str:
        """', tensor parallel 2 (mp, shared-memory all-reduce, 1 thread per rank)', or '' on one process."""
        if self.executor is None:
            return ""
        threads = self.num_threads
        return (f", tensor parallel {self.executor.size} ({self.executor.backend}, "
                f"{'shared-memory' if self.executor.comm.shm is not None else 'gloo'} all-reduce, {threads} "
                f"thread{'s' if threads > 1 else ''} per rank)")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and a KV connector's server, if any (idempotent; also done when the
        engine is collected)."""
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()
        connector = getattr(getattr(self, "runner", None), "kv_connector", None)
        if connector is not None:
            connector.close()

    def lora_description(self) -> str:
        """'4 adapters of rank <= 16 per step (12.3 MiB of slots), 8 kept in memory', or '' without LoRA."""
        if self.lora is None:
            return ""
        c = self.config
        return (f"{c.max_loras} adapter{'s' if c.max_loras > 1 else ''} of rank <= {c.max_lora_rank} per step "
                f"({self.lora.table_bytes / 2**20:.1f} MiB of slots), {c.max_cpu_loras} kept in memory")

    @functools.cached_property
    def num_kv_pool_tokens(self) -> int:
        """Tokens the whole KV cache holds: no single sequence can be longer (with sliding-window layers, the
        longest sequence whose blocks fit the pool)."""
        kv, bs = self.kv, self.block_size
        if not kv.groups.has_windows:
            return kv.num_usable_blocks * bs
        lo, hi = 0, max(self.max_model_len, kv.num_usable_blocks * bs)   # blocks_needed grows with the length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if kv.blocks_needed(mid, self.max_num_batched_tokens) <= kv.num_usable_blocks \
                else (lo, mid - 1)
        return lo

    # ----- set-up -----
    def _max_num_batched_tokens(self) -> int:
        """The step token budget: 1024 on CPU, which measured best (benchmarks/LOG.md); on CUDA bigger steps pay.
        Without chunked prefill, a whole prompt must fit one step."""
        n = self.config.max_num_batched_tokens
        if n is None:
            n = 1024 if self.device.type == "cpu" else 8192
            if not self.config.enable_chunked_prefill:
                n = max(n, self.max_model_len)
        elif not self.config.enable_chunked_prefill and n < self.max_model_len:
            raise InvalidRequestError(f"without chunked prefill, max_num_batched_tokens ({n}) must be at least "
                                      f"max_model_len ({self.max_model_len}): a whole prompt runs in one step",
                                      "max_num_batched_tokens")
        return n

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:   # an embedding model's own limit, as sentence-transformers keeps it
            return min(limit, self.model_config.max_seq_length or limit)
        if self.config.max_model_len > limit:
            raise InvalidRequestError(f"max_model_len {self.config.max_model_len} exceeds the model's context "
                                      f"length {limit}", "max_model_len")
        return self.config.max_model_len

    # ----- requests -----
    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, pooling_params: PoolingParams | None = None,
                    beam_search: BeamSearchParams | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError and queues nothing if it is bad. lora_request:
        the adapter it runs with (a new one is loaded now; LoRAError if it is bad). pooling_params: a pooling
        request (LLM.embed), which computes its prompt and returns one vector instead of generating. beam_search:
        a beam search (beam_group.py), whose one output holds the best beam_width sequences."""
        if beam_search is not None:
            params = beam_request_params(beam_search, self.spec_config is not None)
        if pooling_params is None and (self.is_encoder or self.config.runner == "pooling"):
            raise refuse_generation(self.model_config.architecture, self.is_encoder)
        pooling = None
        if pooling_params is not None:
            pooling = pooling_state(pooling_params, self.model_config, self.is_encoder)
            params = SamplingParams(temperature=0, max_tokens=1)   # the scheduler's bookkeeping: no token is drawn
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if self.id_in_use(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, token_ids = process_prompt(prompt, self.tokenizer, self.vocab_size)
        room = 0 if pooling_params is not None else max(1, params.max_tokens or 1)   # -1: what leaves this free
        token_ids = truncate_prompt(token_ids, (pooling_params or params).truncate_prompt_tokens, self.max_model_len,
                                    min(room, self.max_model_len - 1), self.tokenizer)
        if isinstance(prompt, dict) and cache_salt is None:
            cache_salt = prompt.get("cache_salt")   # vLLM's place for it in offline prompts
        params.verify_for_model(self.vocab_size)
        params.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        check_allowed_tokens(params, self.eos_token_ids)
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} is more samples than the engine runs at once "
                                      f"(max_num_seqs={self.config.max_num_seqs})", "n")
        if pooling is None:
            max_tokens = self._check_fits(len(token_ids), params)
        else:
            check_pooling_fits(len(token_ids), self.max_model_len, self.num_kv_pool_tokens,
                               self.max_num_batched_tokens, self.is_encoder)
            max_tokens = 1
        priority = self._check_priority(priority)
        self._check_lora(lora_request)
        children = self._children(request_id, token_ids, params, arrival_time, priority, max_tokens, cache_salt,
                                  lora_request, pooling)
        group = None
        if beam_search is not None:
            group = children[0].beam = BeamGroup(request_id, children[0], beam_search, self.eos_token_ids,
                                                 self.block_size)
        self.processor.add(ParentState(request_id, text, token_ids, params, beam=group), children)
        if lora_request is not None:   # unpinned as each sample leaves the scheduler (_on_request_finished)
            for _ in children:
                self.lora.pin(lora_request.lora_int_id)
        try:
            self.scheduler.add_request(children[0], siblings=children[1:])
        except BaseException:
            unseen = [c for c in children if c.request_id not in self.scheduler.requests]
            self._abort(request_id, build_output=False)   # all or nothing: no half-added request may stay behind
            for c in unseen if lora_request is not None else ():
                self.lora.unpin(c.lora_id)   # the scheduler never saw it, so never tells us it left
            raise
        return request_id

    def _check_priority(self, priority) -> int:
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**63 <= priority < 2**63:
            raise InvalidRequestError(f"priority must be a 64-bit integer, got {priority!r}", "priority")
        return priority if self.config.scheduling_policy == "priority" else 0   # only that policy orders by it

    def _children(self, request_id: str, token_ids: list[int], params: SamplingParams, arrival_time, priority: int,
                  max_tokens: int, cache_salt, lora_request, pooling) -> list[Request]:
        """The request's Request objects: one, or its n samples ("i_<id>", each with its own seed)."""
        grammar = params.structured_outputs   # compiles from now on, on the manager's threads
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone(n=1, seed=params.sample_seed(i))
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            if rid != request_id and self.id_in_use(rid):
                raise InvalidRequestError(f"request id {request_id!r}: its sample {rid!r} would take the id of a "
                                          "request in flight", "request_id")
            children.append(Request(rid, token_ids, child_params, self.eos_token_ids, arrival_time, priority,
                                    max_tokens, cache_salt, lora_request, device=self.device))
            if grammar is not None:
                children[-1].structured_output = self.structured_output.new_request(grammar)
            children[-1].pooling = pooling
            if self.accountant is not None:
                children[-1].accounting = RequestAccounting()
        return children

    def id_in_use(self, request_id: str) -> bool:
        """Whether a request in flight, one of its n > 1 samples ("i_<id>") or beams ("<id>#k") goes by this id."""
        return (request_id in self.processor.parents or request_id in self.processor.children
                or request_id in self.scheduler.requests)

    def _on_request_finished(self, req: Request) -> None:
        """The scheduler let go of `req` (finished, aborted or failed)."""
        try:
            if self.proposer is not None:
                self.proposer.finish(req)
        finally:
            if req.lora_request is not None:
                self.lora.unpin(req.lora_id)

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                                      "lora_request")
        if self.lora is None:
            raise LoRAError("LoRA adapters are not enabled: start the engine with enable_lora=True (--enable-lora)")
        self.lora.prepare(lora_request)

    def _check_fits(self, num_prompt: int, params: SamplingParams) -> int:
        """The request's max_tokens; raises ContextLengthExceededError when it can never fit, whatever max_tokens."""
        if num_prompt >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {num_prompt} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens, which must also leave room for at least one output token", "prompt")
        if num_prompt >= self.num_kv_pool_tokens:
            raise ContextLengthExceededError(self._pool_message(num_prompt, 1, "shorten the prompt"), "prompt")
        if params.max_tokens is None:   # as much as the context and the whole KV pool allow: at least 1
            return min(self.max_model_len, self.num_kv_pool_tokens) - num_prompt
        max_tokens = params.max_tokens
        if num_prompt + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{num_prompt} prompt tokens and asks for max_tokens={max_tokens}; reduce the prompt or max_tokens",
                "max_tokens")
        if num_prompt + max_tokens > self.num_kv_pool_tokens:
            raise ContextLengthExceededError(self._pool_message(num_prompt, max_tokens, "lower max_tokens"),
                                             "max_tokens")
        return max_tokens

    def _pool_message(self, num_prompt: int, num_output: int, remedy: str) -> str:
        need = self.kv.blocks_needed(num_prompt + num_output, self.max_num_batched_tokens)
        return (f"the request needs {need} KV blocks for {num_prompt} prompt + {num_output} output tokens, but the "
                f"whole KV cache has {self.kv.num_usable_blocks} blocks ({self.num_kv_pool_tokens} tokens); {remedy} "
                "or raise kv_cache_memory (--kv-cache-memory)")

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Abort requests by id; frees their KV blocks at once and returns their final outputs."""
        outs = []
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            out = self._abort(rid)
            if out is not None:
                outs.append(out)
        return outs

    def _abort(self, request_id: str, build_output: bool = True) -> RequestOutput | None:
        self.scheduler.finish_requests(self.processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        out = self.processor.abort(request_id, build_output)
        self._drop_finished_pending()
        return out

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished()

    def take_failed_requests(self) -> dict[str, KVServeError]:
        """Requests the engine gave up on since the last call (request id -> error); each is already aborted."""
        failed, self._failed = self._failed, {}
        return failed

    def get_num_unfinished_requests(self) -> int:
        return len(self.processor.parents)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()


def _refuse_for_encoders(config: EngineConfig) -> None:
    """An encoder (BERT) runs without tensor parallelism, LoRA and speculative decoding: refused before any starts."""
    architecture = load_model_config(config).architecture
    if getattr(get_model_class(architecture), "is_encoder", False):
        raise InvalidRequestError(f"{architecture} is an encoder: it runs without tensor_parallel_size > 1, LoRA "
                                  "adapters or speculative decoding", "model")


def _read_template(template: str) -> str:
    """A chat template given as a file path or inline Jinja."""
    if os.path.isfile(template):
        with open(template) as f:
            return f.read()
    if "{" not in template:
        raise InvalidRequestError(f"chat template {template!r} is neither a file nor a Jinja template", "chat_template")
    return template
