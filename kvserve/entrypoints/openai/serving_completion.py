"""POST /v1/completions: prompts (text, token ids or lists of either) to completions, whole or streamed."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.entrypoints.openai.errors import BadRequestError, to_api_error
from kvserve.entrypoints.openai.protocol import CompletionChoice, CompletionLogProbs, CompletionRequest, \
    CompletionResponse
from kvserve.entrypoints.openai.serving_common import SSE_DONE, ChoiceState, OpenAIServing, PromptInput, sse, \
    sse_error, top_logprobs, usage
from kvserve.entrypoints.openai.serving_beam import beam_choices, beam_search, check_beam_search
from kvserve.entrypoints.openai.structured import request_constraint
from kvserve.outputs import Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """Handles /v1/completions."""

    async def create(self, req: CompletionRequest, raw_request: Request):
        """Queue every prompt, then answer with one JSON body or an SSE stream."""
        model = self.check_model(req.model)
        _check_supported(req)
        request_id = self.request_id(raw_request, "cmpl", req.request_id)
        prompts = self._prompts(req)
        constraint, source = request_constraint(req)
        if req.use_beam_search:
            check_beam_search(req, constraint is not None)
            choices, usage_info = beam_choices(prompts, await beam_search(self, request_id, prompts, req,
                                                                                req.max_tokens))
            return JSONResponse(CompletionResponse(
                id=request_id, model=model, usage=usage_info,
                choices=[CompletionChoice(index=i, text=text, finish_reason=reason) for i, text, reason in choices]
            ).model_dump())
        params = [self.sampling_params(req, req.max_tokens, req.logprobs,
                                       req.logprobs if req.echo and req.logprobs is not None else None,
                                       constraint)] * len(prompts)
        streams = await self.add_prompts(request_id, prompts, params, req, source)
        view = _CompletionView(self, req, model, request_id, prompts)
        if req.stream:
            return StreamingResponse(view.stream(self.outputs(streams)), media_type="text/event-stream")
        return JSONResponse(await view.full(self.outputs(streams), len(streams)))

    def _prompts(self, req: CompletionRequest) -> list[PromptInput]:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        return [PromptInput(p, self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens))
                if isinstance(p, str) else PromptInput(None, list(p)) for p in prompt]


class _CompletionView:
    """Builds one request's response (JSON or SSE chunks) from its engine outputs."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, model: str, request_id: str,
                 prompts: list[PromptInput]):
        self.serving = serving
        self.req = req
        self.model = model
        self.request_id = request_id
        self.prompts = prompts
        self.created = int(time.time())

    async def full(self, outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> dict:
        n = self.req.n
        states = [[ChoiceState() for _ in range(n)] for _ in range(num_prompts)]
        last: list[RequestOutput | None] = [None] * num_prompts
        prompt_lps: list = [None] * num_prompts
        async for i, out in outputs:
            for o in out.outputs:
                states[i][o.index].add(o)
            prompt_lps[i] = prompt_lps[i] or out.prompt_logprobs
            last[i] = out
        choices = []
        for i, per_prompt in enumerate(states):
            for j, st in enumerate(per_prompt):
                text = "".join(st.text)
                logprobs = None
                if self.req.echo:
                    text = self._prompt_text(i, last[i]) + text
                if self.req.logprobs is not None:
                    logprobs = self._logprobs(i, st.token_ids, st.logprobs, prompt_lps[i], 0, last[i])
                choices.append(CompletionChoice(index=i * n + j, text=text, logprobs=logprobs,
                                                finish_reason=st.finish_reason, stop_reason=st.stop_reason))
        num_completion = sum(len(st.token_ids) for per_prompt in states for st in per_prompt)
        response = CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage(last, num_completion))
        return response.model_dump()

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        n = self.req.n
        last: dict[int, RequestOutput] = {}
        offsets: dict[int, int] = {}   # per choice: text offset of its next token (logprobs.text_offset)
        finished: set[int] = set()     # with n > 1, a finished choice still appears in its siblings' outputs
        num_completion = 0
        try:
            async for i, out in outputs:
                last[i] = out
                for o in out.outputs:
                    index = i * n + o.index
                    if index in finished:
                        continue
                    if o.finish_reason is not None:
                        finished.add(index)
                    num_completion += len(o.token_ids)
                    first = index not in offsets
                    text, logprobs = o.text, None
                    if first and self.req.echo:
                        text = self._prompt_text(i, out) + text
                    if self.req.logprobs is not None:
                        prompt_lps = out.prompt_logprobs if first else None
                        logprobs = self._logprobs(i, o.token_ids, o.logprobs or [], prompt_lps, offsets.get(index, 0),
                                                  out)
                        offsets[index] = _end_offset(logprobs, offsets.get(index, 0))
                    else:
                        offsets.setdefault(index, 0)
                    if text or o.finish_reason or logprobs is not None and logprobs.tokens:
                        yield sse(self._chunk(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                               finish_reason=o.finish_reason,
                                                               stop_reason=o.stop_reason)))
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield sse(self._chunk(None, usage(list(last.values()), num_completion)))
        except Exception as e:
            yield sse_error(to_api_error(e))
        yield SSE_DONE

    def _chunk(self, choice: CompletionChoice | None, usage_info=None) -> CompletionResponse:
        # `object` set explicitly: chunks are dumped with exclude_unset, and OpenAI's carry it
        chunk = CompletionResponse(id=self.request_id, object="text_completion", created=self.created,
                                   model=self.model, choices=[choice] if choice else [])
        if usage_info is not None:
            chunk.usage = usage_info
        return chunk

    def _prompt_ids(self, i: int, out: RequestOutput | None) -> list[int]:
        """The prompt's tokens as the engine ran them (truncate_prompt_tokens may have cut its start)."""
        return out.prompt_token_ids if out is not None and out.prompt_token_ids is not None else \
            self.prompts[i].token_ids

    def _prompt_text(self, i: int, out: RequestOutput | None) -> str:
        p, ids = self.prompts[i], self._prompt_ids(i, out)
        return p.text if p.text is not None and ids == p.token_ids else self.serving.tokenizer.decode(ids)

    def _logprobs(self, i: int, token_ids: list[int], logprobs: list[dict[int, Logprob]], prompt_lps,
                  offset: int, request_output: RequestOutput | None) -> CompletionLogProbs:
        """OpenAI's completion logprobs; with echo, the prompt's tokens come first (the first has none)."""
        # every field set explicitly: streamed chunks are dumped with exclude_unset
        out = CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        k = self.req.logprobs
        pairs = list(zip(token_ids, logprobs))
        if self.req.echo and prompt_lps is not None:
            pairs = list(zip(self._prompt_ids(i, request_output), prompt_lps)) + pairs
        for tid, position in pairs:
            chosen = (position or {}).get(tid)
            token = chosen.decoded_token if chosen and chosen.decoded_token is not None else \
                self.serving.tokenizer.decode([tid])
            out.tokens.append(token)
            out.token_logprobs.append(chosen.logprob if chosen else None)
            out.top_logprobs.append(_top_dict(position, tid, k) if position else None)
            out.text_offset.append(offset)
            offset += len(token)
        return out


def _top_dict(position: dict[int, Logprob], chosen: int, k: int) -> dict[str, float]:
    """The chosen token plus the top k, as vLLM returns them (token text -> logprob)."""
    items = [(chosen, position[chosen])] + [item for item in top_logprobs(position, k) if item[0] != chosen]
    return {lp.decoded_token if lp.decoded_token is not None else str(t): lp.logprob for t, lp in items}


def _end_offset(logprobs: CompletionLogProbs, offset: int) -> int:
    if not logprobs.tokens:
        return offset
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def _check_supported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise BadRequestError("suffix is not supported", "suffix", "unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise BadRequestError("best_of is not supported (only best_of == n)", "best_of", "unsupported_parameter")
