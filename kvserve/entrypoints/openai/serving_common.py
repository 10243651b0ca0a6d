"""What completions and chat share: model names, request ids, sampling params, adding prompts, SSE, usage."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.entrypoints.openai.errors import (APIError, BadRequestError, NotFoundError, error_body,
                                               from_validation_error)
from kvserve.entrypoints.openai.protocol import AccountedUsage, OpenAIBaseModel, PromptTokensDetails, \
    SamplingFields, UsageInfo, random_id
from kvserve.engine.prompts import check_text
from kvserve.errors import InvalidRequestError
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("kvserve.server")

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class PromptInput:
    """One prompt as the engine gets it: text (if any) and token ids."""

    text: str | None
    token_ids: list[int]

    def engine_prompt(self) -> dict:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


@dataclass
class ChoiceState:
    """One choice's output accumulated from DELTA outputs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, o: CompletionOutput) -> None:
        if self.finish_reason is not None:
            return   # with n > 1, a finished choice still appears in its siblings' outputs
        self.text.append(o.text)
        self.token_ids.extend(o.token_ids)
        self.logprobs.extend(o.logprobs or [])
        if o.finish_reason is not None:
            self.finish_reason, self.stop_reason = o.finish_reason, o.stop_reason


class OpenAIServing:
    """Base of the completions and chat handlers."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str]):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = engine.engine.max_model_len
        self.loras = engine.engine.lora   # LoRAManager: its named adapters are models too; None without LoRA

    def check_model(self, model: str | None) -> str:
        """The model name to report; 404 when the request names a model (or LoRA adapter) this server does not
        serve."""
        if model is None or model in self.served_model_names:
            return model or self.served_model_names[0]
        if self.lora_request(model) is not None:
            return model
        names = self.served_model_names + (sorted(self.loras.registry) if self.loras is not None else [])
        raise NotFoundError(f"the model {model!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in names)}", "model", "model_not_found")

    def lora_request(self, model: str | None):
        """The LoRA adapter a request's model field names, or None for the base model."""
        return None if self.loras is None or model is None else self.loras.registry.get(model)

    @staticmethod
    def request_id(raw_request: Request, prefix: str, requested: str | None) -> str:
        """'<prefix>-<id>' from the body's request_id, else the X-Request-Id header, else random."""
        base = requested or raw_request.headers.get("x-request-id") or random_id()
        request_id = f"{prefix}-{base}"
        raw_request.state.request_id = request_id
        return request_id

    @staticmethod
    def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams from the request fields; raises InvalidRequestError for out-of-range values."""
        if req.stream_options is not None and not req.stream:
            raise BadRequestError("stream_options is only allowed with stream: true", "stream_options",
                                  "invalid_value")
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias), seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens, output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens)

    async def add_prompts(self, request_id: str, prompts: list[PromptInput], params: list[SamplingParams | None],
                          req: SamplingFields, constraint_source: str | None = None,
                          pooling_params=None, beam_search=None) -> list[RequestStream]:
        """Queue every prompt at once (engine ids '<id>-<i>' when there are several), or none of them. The engine
        names its grammar errors structured_outputs; `constraint_source` is the field the constraint came from.
        pooling_params: pooling requests (embeddings), with params None."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        lora = self.lora_request(req.model)
        if lora is None:
            self.check_model(req.model)   # an adapter unloaded since the request was checked: 404, not the base
        results = await asyncio.gather(
            *(self.engine.add_request(rid, prompt.engine_prompt(), p, priority=req.priority, cache_salt=req.cache_salt,
                                      lora_request=lora, pooling_params=pooling_params, beam_search=beam_search)
              for rid, prompt, p in zip(ids, prompts, params)), return_exceptions=True)
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if not errors:
            return results
        for r in results:
            if isinstance(r, RequestStream):
                self.engine.abort(r.request_id)
        i, e = errors[0]
        if not isinstance(e, InvalidRequestError):
            raise e
        param = constraint_source if e.param == "structured_outputs" and constraint_source else e.param
        if len(prompts) > 1 or param != e.param:
            raise type(e)(f"prompt {i}: {e.message}" if len(prompts) > 1 else e.message, param) from e
        raise e

    async def outputs(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they arrive."""
        if len(streams) == 1:
            async for out in self.engine.generate(streams[0]):
                yield 0, out
            return
        async for item in merge_async_iterators([self.engine.generate(s) for s in streams]):
            yield item


MAX_JSON_DEPTH = 64   # far beyond any OpenAI request (tool schemas included); bounds recursion everywhere after


async def parse_body(raw_request: Request, model_cls: type[OpenAIBaseModel]) -> OpenAIBaseModel:
    """The JSON body validated as `model_cls`; 400 saying what is wrong otherwise."""
    body = await raw_request.body()
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise BadRequestError(f"the request body is not valid JSON: {e}", None, "invalid_json") from e
    except RecursionError:
        raise BadRequestError(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", None,
                              "invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequestError("the request body must be a JSON object", None, "invalid_json")
    check_json_values(data)
    try:
        req = model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from e
    if req.ignored_fields():
        logger.info("ignoring unsupported fields in %s: %s", raw_request.url.path, ", ".join(req.ignored_fields()))
    return req


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value (JSON numbers are finite)")


def check_json_values(data: dict) -> None:
    """400 for what JSON can carry but no field may hold: nesting deeper than MAX_JSON_DEPTH, and strings with
    a lone UTF-16 surrogate ("\\ud800"), which are not Unicode text. Iterative, so no input can exhaust the stack."""
    stack: list[tuple[object, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequestError(f"{_field(path) or 'the request body'} is nested too deeply (at most "
                                  f"{MAX_JSON_DEPTH} levels)", _field(path), "invalid_value")
        if isinstance(value, dict):
            for key, item in value.items():
                check_text(key, path or None, f"a key of {path}" if path else "a field name")
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            check_text(value, path)


def _field(path: str) -> str | None:
    return path.split(".")[0].split("[")[0] or None


def usage(outputs: list[RequestOutput | None], num_completion_tokens: int) -> UsageInfo:
    """Exact token counts of a request's prompts and choices."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    fields = dict(prompt_tokens=prompt, completion_tokens=num_completion_tokens,
                  total_tokens=prompt + num_completion_tokens,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
    accounts = [o.metrics["accounting"] for o in outputs if o is not None and "accounting" in o.metrics]
    if not accounts:
        return UsageInfo(**fields)
    return AccountedUsage(**fields, kvserve_accounting=_merge_accounts(accounts))


def _merge_accounts(accounts: list[dict]) -> dict:
    """Several prompts' accounts as one: tokens and block-seconds summed, times the longest."""
    merged = dict(accounts[0])
    for a in accounts[1:]:
        for key, value in a.items():
            if value is None or merged.get(key) is None:
                merged[key] = merged.get(key) if value is None else value
            elif key.endswith("_seconds") and key != "kv_block_seconds":
                merged[key] = max(merged[key], value)
            else:
                merged[key] += value
    return merged


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def sse_error(err: APIError) -> str:
    return f"data: {json.dumps(error_body(err))}\n\n"


def top_logprobs(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of a position, most likely first."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k),
                  key=lambda item: item[1].rank)[:k]


async def merge_async_iterators(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators, tagged with the iterator's index, in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()   # their generators abort their requests


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out
