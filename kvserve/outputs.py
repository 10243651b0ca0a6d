"""RequestOutput / CompletionOutput: what the engine returns, with vLLM's field names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the sampled/prompt token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (there are n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class PoolingOutput:
    """A request's pooled vector: `embedding` (vLLM's EmbeddingOutput name) or `data`."""

    data: list[float] | None

    @property
    def embedding(self) -> list[float] | None:
        return self.data


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (LLM.embed): vLLM's EmbeddingRequestOutput shape, `outputs.embedding`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


EmbeddingRequestOutput = PoolingRequestOutput


def completions(out: RequestOutput | PoolingRequestOutput) -> list[CompletionOutput]:
    """A generation request's completions; a pooling request has none."""
    return out.outputs if isinstance(out, RequestOutput) else []


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """LLM.score's result for one pair: the cosine similarity of their embeddings (`outputs.score`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
