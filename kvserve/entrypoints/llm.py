"""LLM: the offline API, with vLLM's names (generate, chat) so vLLM scripts run unchanged."""
from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.prompts import PromptType
from kvserve.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvserve.entrypoints.chat_utils import Conversation, apply_chat_template
from kvserve.errors import InvalidRequestError
from kvserve.lora import LoRARequest
from kvserve.outputs import (PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput,
                             completions)
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate text for many prompts at once with continuous batching over a paged KV cache."""

    def __init__(self, model: str | None = None, **kwargs):
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate completions for each prompt; outputs come back in prompt order. lora_request: the adapter
        every prompt runs with, or one per prompt (None: the base model); needs enable_lora=True."""
        prompts = _as_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequestError("priority must have one entry per prompt", "priority")
        loras = _per_prompt(lora_request, len(prompts))
        ids = self._add_all(prompts, params, priority, loras)
        return self._run(ids, use_tqdm)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them (tools: OpenAI tool dicts the template
        shows the model), then generate (lora_request as in generate)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, chat_template, add_generation_prompt,
                                                                continue_final_message, chat_template_kwargs, tools)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: Conversation, chat_template: str | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's (or the given) chat template."""
        return apply_chat_template(self.get_tokenizer(), conversation, chat_template, add_generation_prompt,
                                   continue_final_message, chat_template_kwargs, tools)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[PoolingRequestOutput]:
        """One vector per prompt (`outputs.embedding`), in prompt order: an embedding model's (BERT: its
        sentence-transformers pooling), or a decoder's last hidden state (pooling_params chooses)."""
        prompts = _as_list(prompts)
        loras = _per_prompt(lora_request, len(prompts))
        engine = self.llm_engine
        ids = []
        try:
            for i, prompt in enumerate(prompts):
                ids.append(engine.add_request(None, prompt, lora_request=loras[i],
                                              pooling_params=pooling_params or PoolingParams()))
        except InvalidRequestError as e:
            engine.abort_request(ids)
            raise type(e)(f"prompt {len(ids)}: {e.message}", e.param) from e
        return self._run(ids, use_tqdm)

    def score(self, text_1: PromptType | Sequence[PromptType], text_2: PromptType | Sequence[PromptType],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """The cosine similarity of each pair's embeddings: text_1 against every text_2, or pair by pair when both
        are lists of one length."""
        first, second = _as_list(text_1), _as_list(text_2)
        if len(first) != 1 and len(first) != len(second):
            raise InvalidRequestError(f"text_1 has {len(first)} entries and text_2 {len(second)}: give one text_1, or "
                                      "as many as text_2", "text_1")
        vectors = self.embed(first + second, PoolingParams(normalize=True), use_tqdm=use_tqdm)
        left, right = vectors[:len(first)], vectors[len(first):]
        left = left * len(right) if len(left) == 1 else left
        return [ScoringRequestOutput(f"{a.request_id}-{b.request_id}", a.prompt_token_ids + b.prompt_token_ids,
                                     ScoringOutput(_dot(a.outputs.embedding, b.outputs.embedding)))
                for a, b in zip(left, right)]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The best params.beam_width sequences of each prompt by beam search (vLLM's LLM.beam_search), each with
        its tokens (the prompt's first), text and cumulative logprob, best first. The beams share their blocks
        (copy-on-write); prompts are searched side by side."""
        prompts = _as_list(prompts)
        engine = self.llm_engine
        ids = []
        try:
            for prompt in prompts:
                ids.append(engine.add_request(None, prompt, beam_search=params))
        except InvalidRequestError as e:
            engine.abort_request(ids)
            raise type(e)(f"prompt {len(ids)}: {e.message}" if len(prompts) > 1 else e.message, e.param) from e
        return [BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + o.token_ids, o.cumulative_logprob, o.text,
                                                     finished=True) for o in out.outputs])
                for out in self._run(ids, use_tqdm)]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (refused while requests are running)."""
        return self.llm_engine.reset_prefix_cache()

    # ----- internals -----
    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequestError(f"got {len(params)} sampling params for {n} prompts", "sampling_params")
        return params

    def _add_all(self, prompts, params, priority, loras) -> list[str]:
        """Add every prompt, or none: a bad one raises after the ones already added are withdrawn."""
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if p.output_kind != RequestOutputKind.FINAL_ONLY:
                    p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(engine.add_request(None, prompt, p, priority=priority[i] if priority else 0,
                                              lora_request=loras[i]))
        except InvalidRequestError as e:
            engine.abort_request(ids)
            raise type(e)(f"prompt {len(ids)}: {e.message}", e.param) from e
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
        start, num_in, num_out = time.perf_counter(), 0, 0
        try:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                self._raise_failed(engine.take_failed_requests(), ids, done)
                for out in outputs:
                    if not out.finished:
                        continue
                    done[out.request_id] = out
                    if bar is not None:
                        num_in += len(out.prompt_token_ids)
                        num_out += sum(len(o.token_ids) for o in completions(out))
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"input: {num_in / elapsed:.0f} tok/s, "
                                            f"output: {num_out / elapsed:.0f} tok/s")
                        bar.update(1)
        except BaseException:   # Ctrl-C, or a failure: the call's other requests must not run in the next one
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def _raise_failed(self, failed: dict, ids: list[str], done: dict) -> None:
        """A request of this call failed: withdraw the call's other requests, raise its typed error."""
        mine = [(i, failed[rid]) for i, rid in enumerate(ids) if rid in failed]
        if not mine:
            return
        self.llm_engine.abort_request([rid for rid in ids if rid not in done and rid not in failed])
        i, error = mine[0]
        if isinstance(error, InvalidRequestError):
            raise type(error)(f"prompt {i}: {error.message}", error.param) from error
        raise type(error)(f"prompt {i}: {error}") from error


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _per_prompt(lora_request, n: int) -> list:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)) or not all(r is None or isinstance(r, LoRARequest)
                                                              for r in lora_request):
        raise InvalidRequestError("lora_request must be a LoRARequest, None, or a list of them (one per prompt)",
                                  "lora_request")
    if len(lora_request) != n:
        raise InvalidRequestError(f"got {len(lora_request)} LoRA requests for {n} prompts", "lora_request")
    return list(lora_request)


def _as_list(prompts) -> list:
    if not isinstance(prompts, (list, tuple)):
        return [prompts]   # one prompt; process_prompt rejects what is not a prompt
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]   # a single prompt given as token ids
    return prompts
