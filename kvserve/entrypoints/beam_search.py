"""Beam search's public types (vLLM's names): BeamSearchParams, and the sequences LLM.beam_search returns. The
search runs in the engine (kvserve/engine/beam_group.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError

MAX_BEAM_WIDTH = 10   # 2 x beam_width logprobs a step: SamplingParams allows 20


@dataclass
class BeamSearchParams:
    """beam_width beams, each at most max_tokens tokens; length_penalty ranks finished beams (vLLM's fields)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def validate(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or \
                not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got "
                                      f"{self.beam_width!r}", "beam_width")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}",
                                      "max_tokens")
        if self.temperature != 0.0:
            raise InvalidRequestError("beam search ranks by the model's own logprobs: temperature must be 0",
                                      "temperature")
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != self.length_penalty:
            raise InvalidRequestError(f"length_penalty must be a number, got {self.length_penalty!r}",
                                      "length_penalty")


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), their cumulative logprob, and its text once decoded."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finished: bool = False


@dataclass
class BeamSearchOutput:
    """A prompt's best beam_width sequences, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
