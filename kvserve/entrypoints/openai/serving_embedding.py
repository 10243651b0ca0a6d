"""POST /v1/embeddings (OpenAI's), and vLLM's /pooling, /score and /rerank: pooling requests through the engine,
batched with everything else it runs. Scores are the cosine similarity of the two texts' normalized embeddings
(a bi-encoder's score)."""
from __future__ import annotations

import base64
import time
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from kvserve.entrypoints.openai.errors import BadRequestError
from kvserve.entrypoints.openai.protocol import OpenAIBaseModel, _is_token_id
from kvserve.entrypoints.openai.serving_common import OpenAIServing, PromptInput
from kvserve.errors import InvalidRequestError
from kvserve.outputs import PoolingRequestOutput
from kvserve.pooling_params import PoolingParams

Inputs = str | list[str] | list[int] | list[list[int]]


def _check_inputs(v: Any, field: str) -> Inputs:
    if isinstance(v, str) and v:
        return v
    if isinstance(v, list) and v:
        if all(isinstance(p, str) and p for p in v) or all(_is_token_id(t) for t in v):
            return v
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in v):
            return v
    raise ValueError(f"{field} must be a non-empty string, a list of them, a list of token ids or a list of "
                     "token-id lists")


class PoolingFields(OpenAIBaseModel):
    """What every pooling route takes besides its inputs."""

    model: str | None = None
    user: str | None = None
    # vLLM extras
    normalize: bool | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None   # each input's last k tokens; -1: max_model_len of them
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None


class EmbeddingRequest(PoolingFields):
    """POST /v1/embeddings (and /pooling)."""

    input: Any = Field(...)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, v: Any) -> Inputs:
        return _check_inputs(v, "input")


class ScoreRequest(PoolingFields):
    """POST /score: text_1 against each text_2 (or pair by pair when both are lists of one length)."""

    text_1: Any = Field(...)
    text_2: Any = Field(...)

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _check_texts(cls, v: Any, info) -> Inputs:
        return _check_inputs(v, info.field_name)


class RerankRequest(PoolingFields):
    """POST /rerank: the documents ordered by their score against the query, the best top_n."""

    query: str = Field(...)
    documents: list[str] = Field(...)
    top_n: int | None = None


class OpenAIServingEmbedding(OpenAIServing):
    """The pooling routes' handlers."""

    async def embed(self, req: PoolingFields, inputs: Inputs, raw_request: Request,
                    dimensions: int | None = None) -> tuple[str, list[PoolingRequestOutput]]:
        """Every input's vector, in input order (one request per input, queued all at once or not at all)."""
        self.check_model(req.model)
        request_id = self.request_id(raw_request, "embd", req.request_id)
        prompts = self._prompts(inputs, req.add_special_tokens)
        params = PoolingParams(normalize=req.normalize, dimensions=dimensions,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
        try:
            streams = await self.add_prompts(request_id, prompts, [None] * len(prompts), req, pooling_params=params)
        except InvalidRequestError as e:   # the engine names the prompt; these routes call it input
            if e.param != "prompt":
                raise
            raise type(e)(e.message, "input") from e
        results: list[PoolingRequestOutput | None] = [None] * len(prompts)
        async for i, out in self.outputs(streams):
            results[i] = out
        return request_id, results

    def _prompts(self, inputs: Inputs, add_special_tokens: bool) -> list[PromptInput]:
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        return [PromptInput(p, self.tokenizer.encode(p, add_special_tokens=add_special_tokens))
                if isinstance(p, str) else PromptInput(None, list(p)) for p in inputs]

    async def create_embedding(self, req: EmbeddingRequest, raw_request: Request, kind: str = "embedding"):
        request_id, outs = await self.embed(req, req.input, raw_request, req.dimensions)
        data = [{"index": i, "object": kind, ("embedding" if kind == "embedding" else "data"):
                 _encode(o.outputs.embedding, req.encoding_format)} for i, o in enumerate(outs)]
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": self.check_model(req.model), "data": data, "usage": _usage(outs)})

    async def create_score(self, req: ScoreRequest, raw_request: Request):
        first = [req.text_1] if isinstance(req.text_1, str) or isinstance(req.text_1[0], int) else req.text_1
        second = [req.text_2] if isinstance(req.text_2, str) or isinstance(req.text_2[0], int) else req.text_2
        if len(first) != 1 and len(first) != len(second):
            raise BadRequestError(f"text_1 has {len(first)} entries and text_2 {len(second)}: give one text_1, or "
                                  "as many as text_2", "text_1", "invalid_value")
        request_id, outs = await self.embed(_normalized(req), first + second, raw_request)
        scores = _cosines(outs[:len(first)], outs[len(first):])
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": self.check_model(req.model), "data": data, "usage": _usage(outs)})

    async def create_rerank(self, req: RerankRequest, raw_request: Request):
        if not req.query or not req.documents or not all(req.documents):
            raise BadRequestError("rerank needs a non-empty query and non-empty documents", "documents",
                                  "invalid_value")
        if req.top_n is not None and req.top_n < 1:
            raise BadRequestError(f"top_n must be >= 1, got {req.top_n}", "top_n", "invalid_value")
        request_id, outs = await self.embed(_normalized(req), [req.query, *req.documents], raw_request)
        scores = _cosines(outs[:1], outs[1:])
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or len(scores)]
        results = [{"index": i, "document": {"text": req.documents[i]}, "relevance_score": scores[i]} for i in order]
        return JSONResponse({"id": request_id, "model": self.check_model(req.model), "results": results,
                             "usage": {"total_tokens": _usage(outs)["total_tokens"]}})


def _normalized(req: PoolingFields) -> PoolingFields:
    """Scores compare unit vectors, whatever the request said."""
    return req.model_copy(update={"normalize": True})


def _cosines(left: list[PoolingRequestOutput], right: list[PoolingRequestOutput]) -> list[float]:
    a = np.asarray([o.outputs.embedding for o in left], dtype=np.float64)
    b = np.asarray([o.outputs.embedding for o in right], dtype=np.float64)
    if len(a) == 1:
        a = np.repeat(a, len(b), axis=0)
    return [float(x) for x in (a * b).sum(axis=1)]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: the little-endian float32 bytes, as OpenAI's clients decode them."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def _usage(outs: list[PoolingRequestOutput]) -> dict:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": n, "total_tokens": n}


__all__ = ["EmbeddingRequest", "OpenAIServingEmbedding", "RerankRequest", "ScoreRequest"]
