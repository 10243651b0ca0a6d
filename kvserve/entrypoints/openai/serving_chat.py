"""POST /v1/chat/completions: messages rendered with the chat template, answered whole or streamed."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.entrypoints.chat_utils import render_chat
from kvserve.entrypoints.openai.errors import BadRequestError, to_api_error
from kvserve.entrypoints.openai.protocol import AssistantMessage, ChatChoice, ChatCompletionChunk, \
    ChatCompletionRequest, ChatCompletionResponse, ChatLogProbs, ChatStreamChoice, ChatTokenLogprob, DeltaMessage, \
    TopLogprob
from kvserve.entrypoints.openai.serving_common import SSE_DONE, ChoiceState, OpenAIServing, PromptInput, sse, \
    sse_error, top_logprobs, usage
from kvserve.outputs import Logprob, RequestOutput

_MAX_TOP_LOGPROBS = 20


class OpenAIServingChat(OpenAIServing):
    """Handles /v1/chat/completions."""

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        """Render the conversation, queue it, then answer with one JSON body or an SSE stream."""
        model = self.check_model(req.model)
        _check_supported(req)
        k = _num_top_logprobs(req)
        request_id = self.request_id(raw_request, "chatcmpl", req.request_id)
        prompt = self.render(req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, requested, k)
        streams = await self.add_prompts(request_id, [prompt], [params], req)
        view = _ChatView(self.tokenizer, req, model, request_id, k)
        if req.stream:
            return StreamingResponse(view.stream(self.outputs(streams)), media_type="text/event-stream")
        return JSONResponse(await view.full(self.outputs(streams)))

    def render(self, req: ChatCompletionRequest) -> PromptInput:
        """The conversation as prompt text and token ids."""
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        text = render_chat(self.tokenizer, messages, req.chat_template, req.add_generation_prompt,
                           req.continue_final_message, req.chat_template_kwargs)
        return PromptInput(text, self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens))


class _ChatView:
    """Builds one chat request's response (JSON or SSE chunks) from its engine outputs."""

    def __init__(self, tokenizer, req: ChatCompletionRequest, model: str, request_id: str, k: int | None):
        self.tokenizer = tokenizer
        self.req = req
        self.model = model
        self.request_id = request_id
        self.k = k
        self.created = int(time.time())

    async def full(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> dict:
        states = [ChoiceState() for _ in range(self.req.n)]
        last = None
        async for _, out in outputs:
            for o in out.outputs:
                states[o.index].add(o)
            last = out
        choices = [ChatChoice(index=i, message=AssistantMessage(content="".join(st.text)),
                              logprobs=self._logprobs(st.token_ids, st.logprobs), finish_reason=st.finish_reason,
                              stop_reason=st.stop_reason) for i, st in enumerate(states)]
        num_completion = sum(len(st.token_ids) for st in states)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage([last], num_completion)).model_dump()

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        last = None
        finished: set[int] = set()   # with n > 1, a finished choice still appears in its siblings' outputs
        num_completion = 0
        try:
            async for _, out in outputs:
                if last is None:
                    # the role goes first, on its own, once the first token exists: clients (vllm bench serve)
                    # take the first chunk as the time to first token
                    for i in range(self.req.n):
                        yield sse(self._chunk(ChatStreamChoice(index=i, logprobs=None, finish_reason=None,
                                                               delta=DeltaMessage(role="assistant", content=""))))
                last = out
                for o in out.outputs:
                    if o.index in finished:
                        continue
                    if o.finish_reason is not None:
                        finished.add(o.index)
                    num_completion += len(o.token_ids)
                    logprobs = self._logprobs(o.token_ids, o.logprobs or [])
                    if not (o.text or o.finish_reason or logprobs and logprobs.content):
                        continue
                    delta = DeltaMessage(content=o.text) if o.text else DeltaMessage()
                    yield sse(self._chunk(ChatStreamChoice(index=o.index, delta=delta, logprobs=logprobs,
                                                           finish_reason=o.finish_reason,
                                                           stop_reason=o.stop_reason)))
            if self.req.stream_options and self.req.stream_options.include_usage:
                chunk = self._chunk(None)
                chunk.usage = usage([last], num_completion)
                yield sse(chunk)
        except Exception as e:
            yield sse_error(to_api_error(e))
        yield SSE_DONE

    def _chunk(self, choice: ChatStreamChoice | None) -> ChatCompletionChunk:
        # `object` set explicitly: chunks are dumped with exclude_unset, and OpenAI's carry it
        return ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk", created=self.created,
                                   model=self.model, choices=[choice] if choice else [])

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]]) -> ChatLogProbs | None:
        if self.k is None:
            return None
        content = []
        for tid, position in zip(token_ids, logprobs):
            chosen = position[tid]
            content.append(ChatTokenLogprob(**self._entry(tid, chosen).model_dump(),
                                            top_logprobs=[self._entry(t, lp) for t, lp in
                                                          top_logprobs(position, self.k)]))
        return ChatLogProbs(content=content)

    def _entry(self, token_id: int, lp: Logprob) -> TopLogprob:
        token = lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([token_id])
        return TopLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode("utf-8")))


def _check_supported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise BadRequestError("tools (function calling) are not supported", "tools", "unsupported_parameter")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise BadRequestError("response_format other than {'type': 'text'} is not supported", "response_format",
                              "unsupported_parameter")


def _num_top_logprobs(req: ChatCompletionRequest) -> int | None:
    """The number of top logprobs to return per token, or None when logprobs are off."""
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequestError("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    if not req.logprobs:
        return None
    k = req.top_logprobs or 0
    if not 0 <= k <= _MAX_TOP_LOGPROBS:
        raise BadRequestError(f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {k}", "top_logprobs",
                              "invalid_value")
    return k
