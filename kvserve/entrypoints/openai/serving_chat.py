"""POST /v1/chat/completions: messages rendered with the chat template, answered whole or streamed."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.entrypoints.chat_utils import render_chat
from kvserve.entrypoints.openai.errors import BadRequestError, to_api_error
from kvserve.entrypoints.openai.protocol import AssistantMessage, ChatChoice, ChatCompletionChunk, \
    ChatCompletionRequest, ChatCompletionResponse, ChatLogProbs, ChatStreamChoice, ChatTokenLogprob, DeltaMessage, \
    TopLogprob
from kvserve.entrypoints.openai.serving_common import SSE_DONE, ChoiceState, OpenAIServing, PromptInput, sse, \
    sse_error, top_logprobs, usage
from kvserve.entrypoints.openai.serving_beam import beam_choices, beam_search, check_beam_search
from kvserve.entrypoints.openai.structured import request_constraint
from kvserve.entrypoints.openai.tools import ToolCallStream, ToolChoice, assemble, resolve_tool_choice
from kvserve.errors import InvalidRequestError
from kvserve.outputs import Logprob, RequestOutput
from kvserve.sampling_params import StructuredOutputsParams

_MAX_TOP_LOGPROBS = 20


class OpenAIServingChat(OpenAIServing):
    """Handles /v1/chat/completions."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False):
        super().__init__(engine, served_model_names)
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        """Render the conversation, queue it, then answer with one JSON body or an SSE stream."""
        model = self.check_model(req.model)
        k = _num_top_logprobs(req)
        tool_choice = resolve_tool_choice(req, self.tool_call_parser, self.enable_auto_tool_choice)
        constraint, source = _constraint(req, tool_choice)
        request_id = self.request_id(raw_request, "chatcmpl", req.request_id)
        check_tool_messages(req.messages)
        prompt = self.render(req, tool_choice)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.use_beam_search:
            check_beam_search(req, constraint is not None)
            choices, usage_info = beam_choices([prompt], await beam_search(self, request_id, [prompt], req,
                                                                                 requested))
            return JSONResponse(ChatCompletionResponse(
                id=request_id, model=model, usage=usage_info,
                choices=[ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=reason)
                         for i, text, reason in choices]).model_dump())
        try:
            params = self.sampling_params(req, requested, k, structured_outputs=constraint)
            streams = await self.add_prompts(request_id, [prompt], [params], req, source)
        except InvalidRequestError as e:   # the limit's field is the one the request used
            if e.param != "max_tokens" or req.max_completion_tokens is None:
                raise
            raise type(e)(e.message.replace("max_tokens", "max_completion_tokens"), "max_completion_tokens") from e
        view = _ChatView(self.tokenizer, req, model, request_id, k, tool_choice)
        if req.stream:
            return StreamingResponse(view.stream(self.outputs(streams)), media_type="text/event-stream")
        return JSONResponse(await view.full(self.outputs(streams)))

    def render(self, req: ChatCompletionRequest, tool_choice: ToolChoice | None) -> PromptInput:
        """The conversation (and the tools, for templates that show them to the model) as text and token ids."""
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        text = render_chat(self.tokenizer, messages, req.chat_template, req.add_generation_prompt,
                           req.continue_final_message, req.chat_template_kwargs,
                           tools=tool_choice.tools if tool_choice else None)
        return PromptInput(text, self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens))


def check_tool_messages(messages) -> None:
    """A tool message must answer a tool call of an earlier assistant message (OpenAI answers 400 otherwise)."""
    call_ids = set()
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            call_ids.update(call.id for call in m.tool_calls if call.id is not None)
        elif m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in call_ids:
            raise BadRequestError(f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no tool call of an "
                                  "earlier assistant message", f"messages[{i}].tool_call_id", "invalid_value")


def _constraint(req: ChatCompletionRequest,
                tool_choice: ToolChoice | None) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output constraint and its source field: the request's own, or the one tool_choice implies."""
    constraint, source = request_constraint(req)
    forced = tool_choice.constraint() if tool_choice else None
    if forced is None:
        return constraint, source
    if constraint is not None:
        raise BadRequestError(f"tool_choice {tool_choice.mode!r} constrains the output to tool calls; it cannot be "
                              f"combined with {source}", "tool_choice", "invalid_value")
    return forced, "tools"


class _ChatView:
    """Builds one chat request's response (JSON or SSE chunks) from its engine outputs."""

    def __init__(self, tokenizer, req: ChatCompletionRequest, model: str, request_id: str, k: int | None,
                 tool_choice: ToolChoice | None):
        self.tokenizer = tokenizer
        self.tool_choice = tool_choice
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
        choices = [self._choice(i, st) for i, st in enumerate(states)]
        num_completion = sum(len(st.token_ids) for st in states)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage([last], num_completion)).model_dump()

    def _choice(self, index: int, st: ChoiceState) -> ChatChoice:
        # the same deltas a stream sends, added up: streamed and whole answers agree by construction
        calls = ToolCallStream(self.tool_choice)
        content, tool_calls = assemble(calls.feed("".join(st.text), done=True))
        return ChatChoice(index=index, message=AssistantMessage(content=content, tool_calls=tool_calls),
                          logprobs=self._logprobs(st.token_ids, st.logprobs),
                          finish_reason=calls.finish_reason(st.finish_reason), stop_reason=st.stop_reason)

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        last = None
        calls = [ToolCallStream(self.tool_choice) for _ in range(self.req.n)]
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
                    deltas = calls[o.index].feed(o.text, o.finish_reason is not None)
                    finish_reason = calls[o.index].finish_reason(o.finish_reason)
                    for choice in _stream_choices(o.index, deltas, logprobs, finish_reason, o.stop_reason):
                        yield sse(self._chunk(choice))
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


def _stream_choices(index: int, deltas: list[DeltaMessage], logprobs: ChatLogProbs | None,
                    finish_reason: str | None, stop_reason) -> list[ChatStreamChoice]:
    """One output's chunks: a chunk per delta, the token logprobs on the first, finish_reason on the last."""
    if not (deltas or finish_reason or logprobs and logprobs.content):
        return []
    deltas = deltas or [DeltaMessage()]
    last = len(deltas) - 1
    # every field set explicitly: chunks are dumped with exclude_unset, and OpenAI's carry them as null
    return [ChatStreamChoice(index=index, delta=delta, logprobs=logprobs if j == 0 else None,
                             finish_reason=finish_reason if j == last else None,
                             stop_reason=stop_reason if j == last else None) for j, delta in enumerate(deltas)]


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
