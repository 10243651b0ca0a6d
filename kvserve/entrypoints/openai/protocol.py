"""Pydantic models of the OpenAI API (requests and responses), with vLLM's extra request fields."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Prompt = str | list[str] | list[int] | list[list[int]]


def random_id() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Strict types (a string is not a number, 1 is not true); unknown fields are kept and reported, not fatal."""

    model_config = ConfigDict(strict=True, extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """response_format.json_schema: a named JSON schema the output must match."""

    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel method; the alias keeps OpenAI's field name on the wire
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    use_beam_search: bool = False       # n beams of beam search as the n choices (not streamed)
    length_penalty: float = 1.0         # beam search: finished beams ranked by logprob / length ** length_penalty
    # constrained decoding (docs/structured_outputs.md): at most one source per request
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None   # vLLM's older names, still sent by many scripts
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Any = Field(...)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Prompt:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v):
                return v
            if all(_is_token_id(t) for t in v):
                return v
            if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in v):
                return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists "
                         f"(got {_type_name(v)})")


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any]   # OpenAI sends JSON text; some clients send the object itself


class ToolCallParam(OpenAIBaseModel):
    """A tool call of an earlier assistant turn, sent back in a follow-up request."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIBaseModel):
    """One message; content is a string or a list of {"type": "text", "text": ...} parts. Assistant messages may
    carry tool_calls (content null), tool messages answer one with tool_call_id."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One entry of `tools`: a function the model may call."""

    type: str   # only "function"; checked with a clear message in tools.py
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: str | dict[str, Any] | None = None   # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


# ----- responses -----
class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class AccountedUsage(UsageInfo):
    """usage with --enable-request-accounting: what the request cost (kvserve/engine/accounting.py)."""

    kvserve_accounting: dict


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str   # JSON text, as OpenAI returns it


class ToolCall(ResponseModel):
    id: str = Field(default_factory=lambda: f"call_{random_id()[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """A piece of a streamed tool call: the first carries id, type and name, later ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT adapter at lora_path as the model lora_name."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter: stop serving the adapter lora_name."""

    lora_name: str
    lora_int_id: int | None = None


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _type_name(v: Any) -> str:
    if isinstance(v, list):
        return "an empty list" if not v else "a list of mixed or unsupported items"
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number",
            dict: "an object"}.get(type(v), type(v).__name__)
