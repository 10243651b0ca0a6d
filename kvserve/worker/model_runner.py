"""ModelRunner: the device side of the engine. It sizes and binds the KV cache, turns a SchedulerOutput into one
flattened forward pass and samples the next tokens."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.attention import build_attention_metadata, build_group_metadata, single_sequence_metadata
from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_groups import KVGroups
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.distributed.message import StepMessage
from kvserve.errors import EngineDeadError
from kvserve.memory import return_freed_memory
from kvserve.model.layers import Linear, VocabEmbedding
from kvserve.sample import Sampler, SamplingMetadata, SamplingRow, compute_prompt_logprobs
from kvserve.sample.metadata import SampledDrafts
from kvserve.sample.sampler import draw_uniform
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.draft_sampling import next_drafts, sampled_drafts
from kvserve.spec_decode.draft_vocab import DraftVocab, draft_logits, own_ids, request_vocab
from kvserve.sample.logprobs import LogprobsTensors
from kvserve.structured_output import build_grammar_bitmask
from kvserve.transfer import to_device, to_host
from kvserve.worker.cuda_graphs import DecodeGraphs
from kvserve.worker.kv_setup import KVCacheSetup
from kvserve.worker.kv_tier import kv_pools
from kvserve.worker.pooling import pool_step
from kvserve.worker.step_pipeline import PendingStep


@dataclass
class StepInputs:
    """One step: the plain message every rank runs (StepMessage), and what the driver does with its logits."""

    message: StepMessage
    sample_reqs: list[Request]        # requests whose step reaches the end of their tokens
    sample_rows: np.ndarray           # flattened rows that sample: per request its last token's, or with
                                      # drafts the k + 1 rows of its last token and its drafts
    prompt_lp: list[tuple[Request, int, int, int]]   # (req, first position, its row, count) for prompt logprobs
    pool: list[tuple[Request, int, int, int]] = field(default_factory=list)   # pooling: pool_step's spans
    # async scheduling: the rows whose token the step in flight samples (0 in input_ids until then), and where
    # each is in that step's sampled tokens
    fixup: tuple[np.ndarray, np.ndarray, torch.Tensor] | None = None


logger = logging.getLogger("kvserve")


def _plain_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the plain (not meta) weights of the model's Linears and embedding."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, (Linear, VocabEmbedding)) and not m.weight.is_meta)


class ModelRunner(KVCacheSetup):
    """Runs the model for scheduled requests and samples one token for each that reached its end."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, device: torch.device, seed: int = 0,
                 draft_model: torch.nn.Module | None = None):
        self.model = model
        # speculative decoding with a draft model: it runs with the target over the tokens whose KV it lacks (its own
        # KV pools, the same block tables; _write_draft_kv), then guesses the next drafts (propose_drafts)
        self.draft_model = draft_model
        self.kv_groups: KVGroups | None = None   # init_kv_cache: the KV groups of sliding-window layers
        self.kv: KVCacheManager | None = None   # set by init_kv_cache()
        self.tier_storage = None   # the host KV tier's bytes, where there is one (kv_setup.py)
        self.kv_connector = None   # the KV connector of kv_transfer_config (kv_setup.py)
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        # requests without a seed of their own draw from this one: the same seed and requests, the same outputs
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.released_weight_bytes = 0
        for m in self.models:
            if device.type == "cpu" and hasattr(m, "prepack"):
                # bf16 weights packed for the C++ matmul kernels (or oneDNN): kvserve/csrc/gemv.cpp. Serving reads
                # only the packs: each plain weight is dropped as soon as its pack is made (never all of both)
                plain = _plain_weight_bytes(m)
                m.prepack(release=True)
                self.released_weight_bytes += plain - _plain_weight_bytes(m)
        if device.type == "cpu":
            return_freed_memory()
        self.lora = None   # the engine's LoRAManager when LoRA is enabled (kvserve/lora)
        self.executor = None   # tensor parallelism: the driver's TPExecutor, which sends every step to the workers
        self._calls_left = 0   # the step's compute_logits calls not made yet (-1: its forward is not done)
        self.decode_graphs: DecodeGraphs | None = None   # CUDA: decode steps through captured graphs

    @property
    def models(self) -> list[torch.nn.Module]:
        """The target model, then the draft model if there is one: each has KV pools over the same blocks."""
        return [self.model] if self.draft_model is None else [self.model, self.draft_model]

    # ----- the KV cache: the runner owns all device memory -----
    @torch.inference_mode()
    def profile_step(self, config: EngineConfig, num_tokens: int) -> int:
        """The largest step's work, to measure its peak memory: a forward over num_tokens tokens (the model's KV
        pools bound), then logits and sampling for as many rows as a step samples at most (max_num_seqs; with
        speculation k + 1 for each of the requests that may draft, disable_by_batch_size), at their most costly:
        random draws under top-p (a sort of every row) with logprobs, verifying drafts drawn from a distribution q
        where a draft model proposes them. Returns the rows sampled."""
        spec = config.speculative_config
        per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        rows = config.max_num_seqs
        if per_seq > 1:   # drafts only while at most disable_by_batch_size requests run
            cap = spec.disable_by_batch_size
            rows = max(rows, min(rows, cap if cap is not None else rows) * per_seq)
        rows = min(num_tokens, rows)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device),
                            single_sequence_metadata(num_tokens, config.block_size, self.device))
        logits = self.model.compute_logits(hidden[-rows:])
        del hidden
        params = SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5, logprobs=20)
        meta = SamplingMetadata.build([SamplingRow(params, [], [0])] * rows, self.vocab_size, self.device,
                                      torch.Generator(device=self.device))   # the engine's stream stays untouched
        if self.draft_model is not None and per_seq > 1:
            verifying = torch.arange(rows, device=self.device)
            verifying = verifying[verifying % per_seq != per_seq - 1]   # each sequence's last row is its bonus
            q = torch.full((len(verifying), self.vocab_size), 1.0 / self.vocab_size, device=self.device)
            meta.sampled_drafts = SampledDrafts(verifying, torch.zeros_like(verifying), q)
        self.sampler(logits, meta)
        return rows

    # ----- steps -----
    def prepare_inputs(self, sched: SchedulerOutput, prev: PendingStep | None = None) -> StepInputs:
        """The step's inputs; `prev`: the step in flight (async scheduling), whose sampled tokens are this step's
        inputs where a request holds a placeholder."""
        query_lens, seq_lens, tables, ids = [], [], [], []
        sample_reqs, sample_rows, prompt_lp, pool = [], [], [], []
        fix_rows, fix_src = [], []
        row = 0
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            num_drafts = len(req.spec_token_ids)   # the scheduler left only those within the step's budget
            known = req.all_token_ids[start:start + n]
            ids.extend(known)
            if len(known) < n - num_drafts:   # its last input is the token the step in flight samples for it
                if prev is None or req.request_id not in prev.index or len(known) != n - num_drafts - 1:
                    raise RuntimeError(f"request {req.request_id}: {n - num_drafts - len(known)} input token(s) "
                                       "not known and not in flight")
                fix_rows.append(row + n - 1)
                fix_src.append(prev.index[req.request_id])
                ids.append(0)
            if num_drafts:
                ids.extend(req.spec_token_ids)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(self.kv.get_group_block_ids(req.request_id))
            if req.pooling is not None:
                pool.append((req, row, n, start))
            elif start + n == req.num_tokens + req.num_placeholders + num_drafts:
                sample_reqs.append(req)
                sample_rows.extend(range(row + n - 1 - num_drafts, row + n))
            if req.params.prompt_logprobs is not None:
                # row r predicts token r + 1; targets are prompt positions not yet scored, up to the last prompt token
                first = max(start, req.num_prompt_logprobs_done)
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > first:
                    prompt_lp.append((req, first, row + first - start, last - first))
            row += n
        # the step's compute_logits calls, in the order the driver makes them: prompt logprobs, then sampling
        calls = [np.arange(r, r + count) for _, _, r, count in prompt_lp] + ([sample_rows] if sample_reqs else [])
        lora_rows, lora_slots = self._lora_step(sched) if self.lora is not None else ((), [])
        # each token's position: its sequence's first new position (seq_len - query_len) plus its offset in the step
        qlens = np.asarray(query_lens, np.int64)
        firsts = np.asarray(seq_lens, np.int64) - qlens
        pos = np.arange(row, dtype=np.int64) + np.repeat(firsts - (np.cumsum(qlens) - qlens), qlens)
        message = StepMessage.build(ids, pos, qlens, seq_lens, tables, sched.block_copies, calls, lora_rows,
                                    lora_slots)
        fixup = (np.asarray(fix_rows, np.int64), np.asarray(fix_src, np.int64), prev.sampled) if fix_rows else None
        return StepInputs(message, sample_reqs, np.asarray(sample_rows, np.int64), prompt_lp, pool, fixup)

    def _lora_step(self, sched: SchedulerOutput) -> tuple[np.ndarray, list]:
        """Put the step's adapters into slots: (each row's slot, -1 for the base model; the slots' adapters, which
        tensor-parallel workers mirror), or nothing when no request of the step has an adapter."""
        adapters = [req.lora_request for req, _ in sched.scheduled if req.lora_request is not None]
        if not adapters:
            return np.empty(0, np.int64), []
        slot_of = self.lora.activate(adapters)
        slots = np.array([-1 if req.lora_id is None else slot_of[req.lora_id] for req, _ in sched.scheduled])
        return np.repeat(slots, [n for _, n in sched.scheduled]), self.lora.slot_table(slot_of)

    def _long(self, values) -> torch.Tensor:
        return to_device(values, torch.long, self.device)

    def _fill_in(self, ids: torch.Tensor, fixup) -> None:
        """Async scheduling: the tokens the step before samples, into `ids` on the device (no wait for them)."""
        rows, src, sampled = fixup
        ids.index_copy_(0, self._long(rows), sampled.index_select(0, self._long(src)))

    def run_forward(self, msg: StepMessage, fixup=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's forward from its message, as every tensor-parallel rank runs it: (hidden, ids, positions).
        `fixup`: StepInputs.fixup (async scheduling, one process)."""
        if len(msg.block_copies):
            self._copy_blocks(msg.block_copies.tolist())
        groups = msg.padded_tables()
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(msg.query_lens, groups[0][1]):
            n = len(msg.input_ids)
            fill = None if fixup is None else (lambda ids: self._fill_in(ids, fixup))
            hidden = graphs.run(msg.input_ids, msg.positions, msg.seq_lens, groups[0][0], fill)
            return hidden, graphs.input_ids[:n], graphs.positions[:n]
        meta = build_group_metadata(msg.query_lens, msg.seq_lens, groups, self.kv.block_size, self.device)
        ids, positions = self._long(msg.input_ids), self._long(msg.positions)
        if fixup is not None:
            ids = ids.clone()   # on the CPU it is the message's own array
            self._fill_in(ids, fixup)
        if self.lora is None or not len(msg.lora_rows):
            return self.model(ids, positions, meta), ids, positions
        self.lora.mirror(msg.lora_slots)   # a worker's slots follow the driver's (on the driver: already so)
        self.lora.mapping.set(msg.lora_rows.astype(np.int32), self.device)
        try:
            return self.model(ids, positions, meta), ids, positions
        finally:
            self.lora.mapping.clear()

    def iter_logits(self, hidden: torch.Tensor, msg: StepMessage) -> Iterator[torch.Tensor | None]:
        """Every compute_logits call of the step, in order, one at a time (tensor-parallel: every rank makes them
        all; rank 0 gets the logits, the others None). _calls_left counts those not made yet."""
        calls = msg.logits_calls()
        self._calls_left = len(calls)
        for rows in calls:
            logits = self.model.compute_logits(hidden[self._long(rows)])
            self._calls_left -= 1
            yield logits

    @torch.inference_mode()
    def execute_step_message(self, msg: StepMessage) -> None:
        """A tensor-parallel worker's step: the driver's forward and logits calls on this rank's shard."""
        hidden, _, _ = self.run_forward(msg)
        for _ in self.iter_logits(hidden, msg):
            pass

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        """One forward over every scheduled token; returns request id -> the tokens it emits (one, or with drafts
        the accepted drafts and one more)."""
        inp = self.prepare_inputs(sched)
        if self.executor is None:
            return self._execute(sched, inp)
        self.executor.send_step(inp.message)   # the other ranks run the same step on their shards
        self._calls_left = -1   # the forward's collectives are still to come
        try:
            return self._execute(sched, inp)
        except EngineDeadError:
            raise
        except BaseException as e:   # Ctrl-C too: LLM.generate survives it, the group would not
            if self._calls_left == 0:
                raise   # every collective of the step was made: only its requests fail, as on one process
            # the other ranks wait in this step's collectives: the ranks can no longer be paired up again
            message = f"rank 0 failed in the middle of a step: {type(e).__name__}: {e}"
            self.executor.fail(message)
            if not isinstance(e, Exception):
                raise
            raise EngineDeadError(message) from e

    def _execute(self, sched: SchedulerOutput, inp: StepInputs) -> dict[str, list[int]]:
        out, states, pooled = self._forward_and_sample(sched, inp)
        if out is None:
            return pooled
        return {**self._emit(out.sampled_token_ids.tolist(), out.logprobs, inp.sample_reqs, states), **pooled}

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: PendingStep | None) -> PendingStep:
        """Async scheduling: run the step up to its sampled tokens on the device and start their copy to the host,
        without waiting for either (on a GPU, the host goes on while the device works); finish_step() waits.
        `prev`: the step still in flight, whose sampled tokens this step's placeholders read on the device."""
        inp = self.prepare_inputs(sched, prev)
        out, _, pooled = self._forward_and_sample(sched, inp)
        if out is None:
            return PendingStep(sched, [], {}, None, to_host([]), pooled)
        lp = out.logprobs
        copy = to_host([out.sampled_token_ids] + ([lp.token_ids, lp.logprobs, lp.ranks] if lp is not None else []))
        return PendingStep(sched, inp.sample_reqs, {r.request_id: i for i, r in enumerate(inp.sample_reqs)},
                           out.sampled_token_ids, copy, pooled)

    def finish_step(self, pending: PendingStep) -> dict[str, list[int]]:
        """Wait for a launched step's tokens: request id -> the tokens it emits, as execute_model returns."""
        host = pending.copy.wait()
        if not pending.reqs:
            return pending.pooled
        lp = LogprobsTensors(*host[1:]) if len(host) > 1 else None
        return {**self._emit(host[0].tolist(), lp, pending.reqs, {}), **pending.pooled}

    def _forward_and_sample(self, sched: SchedulerOutput, inp: StepInputs):
        """The step on the device: (the sampler's output or None, the seeded generators' states before drafts were
        sampled, the pooled vectors)."""
        self.move_tier_blocks(inp.message)
        hidden, ids, _ = self.run_forward(inp.message, inp.fixup)
        if self.draft_model is not None:
            self._write_draft_kv(sched, ids)
        self.save_to_connector(sched)
        self._calls_left = len(inp.message.logits_lens)
        logits = self.iter_logits(hidden, inp.message)
        if inp.prompt_lp:
            self._prompt_logprobs(logits, inp)
        pooled = pool_step(hidden, inp.pool) if inp.pool else {}
        if not inp.sample_reqs:
            return None, {}, pooled
        out, states = self._sample(next(logits), inp.sample_reqs)
        return out, states, pooled

    def _sample(self, logits: torch.Tensor, reqs: list[Request]):
        """Sample every row (on the device); _emit then keeps per request its drafts up to the first one the target
        disagrees with. Returns (the sampler's output, the seeded generators' states before drafts were sampled).

        A request with k drafts has k + 1 rows, row j sampled as if drafts 1..j were already its output (penalties,
        min_tokens), with the j-th draw of its generator: the token the request would sample there without
        speculation. Where a proposal is deterministic (the proposer's q one-hot: n-gram, suffix, and the draft
        model's argmax for greedy and seeded requests), accepting draft j exactly when it equals that token is
        rejection sampling (accept with probability p(d) = min(1, p/q); on rejection the token is distributed as
        norm(max(0, p - q))); the row after the last accepted draft gives the recovered token, or the bonus token
        when all k are accepted. Seeded requests then give the same output with and without speculation: their
        generators are rewound to the draws actually used. Drafts drawn from the draft model's distribution q
        (random requests without a seed) are kept with probability min(1, p/q) instead
        (kvserve.spec_decode.draft_sampling)."""
        rows, states = [], {}
        for req in reqs:
            drafts = req.spec_token_ids
            if drafts and req.generator is not None and not req.params.is_greedy:
                states[req.request_id] = req.generator.get_state()
            rows += [req.sampling_row(drafts[:j], req.generator) for j in range(len(drafts) + 1)]
        meta = SamplingMetadata.build(rows, self.vocab_size, self.device, self.generator)
        meta.grammar_bitmask = build_grammar_bitmask(reqs, self.vocab_size)
        meta.sampled_drafts = sampled_drafts(reqs, self.device)
        return self.sampler(logits, meta), states

    def _emit(self, sampled: list[int], logprobs, reqs: list[Request], states: dict) -> dict[str, list[int]]:
        """Per request the tokens it emits (the accepted drafts and one more), from the sampled rows."""
        emitted, emitted_rows, row = {}, [], 0
        for req in reqs:
            drafts = req.spec_token_ids
            num = accepted_length(drafts, sampled[row:row + len(drafts)]) + 1
            emitted[req.request_id] = sampled[row:row + num]
            emitted_rows.append(range(row, row + num))
            if req.request_id in states:
                _rewind(req.generator, states[req.request_id], num)
            row += len(drafts) + 1
        if logprobs is not None:
            self._record_logprobs(reqs, emitted_rows, logprobs)
        return emitted

    # ----- speculative decoding: the draft model's proposals -----
    def _write_draft_kv(self, sched: SchedulerOutput, input_ids: torch.Tensor) -> None:
        """The draft model's KV for the step's requests that do not verify drafts (prefill chunks, decodes), from
        the first position whose draft KV is missing.

        A request verifying k drafts is left out: its proposal wrote the draft KV of its last token and of d1..d(k-1);
        what it lacks once the target has accepted some (dk, when all k are) its next proposal writes in the same
        draft forward as its first draft (propose_drafts), and a decode without a proposal here. The KV of an
        accepted draft is right as written: the missing positions start at min(draft_kv_end, num_computed_tokens),
        the rollback having set num_computed_tokens back past the rejected ones."""
        step_ids = None
        ids, pos, query_lens, seq_lens, tables, row = [], [], [], [], [], 0
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            if not req.spec_token_ids:
                first = min(req.draft_kv_end, start)
                if step_ids is None:
                    step_ids = input_ids.tolist()
                ids += req.all_token_ids[first:start] + step_ids[row:row + n]
                pos.extend(range(first, start + n))
                query_lens.append(start + n - first)
                seq_lens.append(start + n)
                tables.append(self.kv.get_block_ids(req.request_id))
                req.draft_kv_end = start + n
            row += n
        if ids:
            meta = build_attention_metadata(query_lens, seq_lens, tables, self.kv.block_size, self.device)
            self.draft_model(self._long(ids), self._long(pos), meta)   # only its KV is wanted

    @torch.inference_mode()
    def propose_drafts(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Up to max_drafts[i] drafts for each request, by the draft model, batched over the requests, one draft
        forward per draft position: its argmax, or for random requests without a seed a draw from its distribution
        q, kept in req.spec_draft_probs (draft_sampling.next_drafts). The first one also writes the draft KV the
        request lacks before its last token (the last draft of a verification that accepted all). The draft writes
        its KV for the last token and the drafts but the last, in slots allocated now (those the next step needs
        anyway); a request the pool has no room for gets none."""
        live, limits = [], []
        for req, limit in zip(reqs, max_drafts):
            # the next step computes positions num_tokens - 1 .. num_tokens - 1 + limit; the draft writes all but
            # the last
            if limit > 0 and self.kv.allocate_slots(req, limit) is not None:
                live.append(req)
                limits.append(limit)
        self.move_tier_blocks()   # blocks these allocations evicted are saved before the draft writes them
        copies = self.kv.take_block_copies()
        if copies:   # copy-on-write before the draft writes into the copies
            self._copy_blocks(copies)
            if self.executor is not None:   # the other ranks' pools of the target too, before their next step
                self.executor.send_block_copies(copies)
        drafts = [[] for _ in live]
        probs: list[list[torch.Tensor]] = [[] for _ in live]
        vocabs = [self._draft_vocab(req) for req in live]
        own = own_ids(vocabs)
        for step in range(max(limits, default=0)):
            idx = [i for i, limit in enumerate(limits) if limit > step]
            if step:
                ids = [drafts[i][-1] for i in idx]
                positions = [live[i].num_tokens - 1 + step for i in idx]
                query_lens = [1] * len(idx)
            else:   # from the first position whose draft KV is missing to the last token
                firsts = [min(live[i].draft_kv_end, live[i].num_computed_tokens) for i in idx]
                ids = [t for i, f in zip(idx, firsts) for t in live[i].all_token_ids[f:]]
                positions = [p for i, f in zip(idx, firsts) for p in range(f, live[i].num_tokens)]
                query_lens = [live[i].num_tokens - f for i, f in zip(idx, firsts)]
            meta = build_attention_metadata(query_lens, [live[i].num_tokens + step for i in idx],
                                            [self.kv.get_block_ids(live[i].request_id) for i in idx],
                                            self.kv.block_size, self.device)
            hidden = self.draft_model(self._long(ids), self._long(positions), meta)
            if len(ids) > len(idx):   # the last row of each request
                hidden = hidden[self._long(np.cumsum(query_lens) - 1)]
            logits = draft_logits(self.draft_model, hidden, [vocabs[i] for i in idx], own)
            drawn = next_drafts(logits, [live[i] for i in idx], [drafts[i] for i in idx], self.vocab_size,
                                self.generator)
            for i, (token, q) in zip(idx, drawn):
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
        for req in reqs:
            req.spec_draft_probs = None
        for req, limit, q in zip(live, limits, probs):
            req.draft_kv_end = req.num_tokens - 1 + limit
            req.spec_draft_probs = torch.stack(q) if q else None
        by_req = {id(req): d for req, d in zip(live, drafts)}
        return [by_req.get(id(req), []) for req in reqs]

    def _draft_vocab(self, req: Request) -> DraftVocab | None:
        """What `req` drafts from: its DraftVocab (the cut and its own tokens past it), or None for the whole
        vocabulary: always without a cut (draft_vocab_size), else while its output brings new tokens past the cut
        (spec_decode.draft_vocab)."""
        head = self.draft_model.cut_lm_head
        if head is None:
            return None
        vocab = request_vocab(req, head.weight.shape[0])
        return None if vocab.is_whole() else vocab

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies sent by the driver outside a step (a tensor-parallel worker)."""
        self._copy_blocks(copies)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks into the fresh ones before they are written."""
        src = to_device([c[0] for c in copies], torch.long, self.device)
        dst = to_device([c[1] for c in copies], torch.long, self.device)
        # each distinct pool once (KV groups: layers share pools, and a pool copied twice would read a block already
        # overwritten), as bytes (torch has no index_copy_ for float8 pools)
        for raw in kv_pools(self.models):
            raw.index_copy_(0, dst, raw.index_select(0, src))

    def _record_logprobs(self, reqs: list[Request], emitted_rows: list[range], lp) -> None:
        rows_lp = lp.on_host()
        for req, rows in zip(reqs, emitted_rows):
            k = req.params.logprobs
            if k is None or req.is_finished:   # (async scheduling: finished or aborted since its step launched)
                continue
            for i in rows:
                req.logprobs.append(rows_lp.dict(i, k))
                req.cumulative_logprob += rows_lp.vals[i][0]

    def _prompt_logprobs(self, logits: Iterator[torch.Tensor], inp: StepInputs) -> None:
        # zip takes a request first, so `logits` yields exactly one call per request and no more
        for (req, first, _, count), step_logits in zip(inp.prompt_lp, logits):
            k = req.params.prompt_logprobs
            if first == 0:
                req.prompt_logprobs = [None]   # the first prompt token has no logprob
            targets = self._long(req.prompt_token_ids[first + 1:first + 1 + count])
            rows_lp = compute_prompt_logprobs(step_logits, targets, k).on_host()
            req.prompt_logprobs.extend(rows_lp.dict(j, k) for j in range(count))
            req.num_prompt_logprobs_done = first + count


def accepted_length(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the tokens the target sampled at their positions."""
    for j, (draft, token) in enumerate(zip(drafts, sampled)):
        if draft != token:
            return j
    return len(drafts)


def _rewind(generator: torch.Generator, state: torch.Tensor, num_rows: int) -> None:
    """Set `generator` to where sampling `num_rows` rows from `state` leaves it (one draw per row)."""
    generator.set_state(state)
    for _ in range(num_rows):
        draw_uniform(generator)

