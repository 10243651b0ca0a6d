"""Beam search (vLLM's LLM.beam_search and the server's use_beam_search), over the engine's ordinary requests.

Each step asks the engine for one token of every live beam of every prompt, with the top 2 x beam_width logprobs;
a beam's request is its prompt plus its tokens, so the prefix cache finds the blocks it shares with its parent
(the prompt's and every full block of its tokens) and only the last partial block is computed again: beams share
their KV without copies. The choice of beams is transformers' generate(num_beams=..., do_sample=False) with its
defaults (early_stopping False):

    candidates: the best 2 x beam_width (beam + token) by cumulative logprob
    live beams: the best beam_width candidates that do not end in EOS
    finished:   those among the best beam_width candidates that end in EOS (or reach max_tokens), scored
                cumulative logprob / generated length ** length_penalty; the best beam_width kept
    stop:       at max_tokens, or once beam_width are finished and the best live beam, scored at its current
                length, cannot beat the worst of them
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

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




class BeamSearch:
    """The beams of one prompt."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int]):
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.eos = set() if params.ignore_eos else eos_token_ids
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.finished: list[tuple[float, BeamSearchSequence]] = []   # (score, beam), best first

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """One token more: each live beam's candidates from its step's logprobs."""
        width = self.params.beam_width
        candidates = [BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + lp.logprob)
                      for beam, out in zip(self.live, outputs) for token, lp in out.outputs[0].logprobs[0].items()]
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        candidates = candidates[:2 * width]
        generated = len(candidates[0].tokens) - self.prompt_len
        last = generated >= self.params.max_tokens
        ends = [last or c.tokens[-1] in self.eos for c in candidates]
        for cand, end in zip(candidates[:width], ends[:width]):
            if end:
                cand.finished = True
                self.finished.append((cand.cum_logprob / generated ** self.params.length_penalty, cand))
        self.finished = sorted(self.finished, key=lambda f: f[0], reverse=True)[:width]
        self.live = [c for c, end in zip(candidates, ends) if not end][:width]
        if last or not self.live or (len(self.finished) == width and self.finished[-1][0] >=
                                     self.live[0].cum_logprob / generated ** self.params.length_penalty):
            self.live = []   # done: no live beam can improve on the finished ones

    def best(self) -> list[BeamSearchSequence]:
        return [beam for _, beam in self.finished]


class BeamSearchRound:
    """Beam search over several prompts at once: each round one engine call for all their live beams.

        search = BeamSearchRound(prompts, params, eos)
        while search.beams():                       # the token lists to run, one token each
            search.advance(outputs, ...)            # the engine's outputs, in that order
        search.best()
    """

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int]):
        params.validate()
        self.searches = [BeamSearch(p, params, eos_token_ids) for p in prompts]
        self.step_params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * params.beam_width,
                                          ignore_eos=True)

    def beams(self) -> list[list[int]]:
        return [b.tokens for s in self.searches for b in s.live]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        i = 0
        for s in self.searches:
            n = len(s.live)
            if n:
                s.advance(outputs[i:i + n])
                i += n

    def best(self) -> list[list[BeamSearchSequence]]:
        return [s.best() for s in self.searches]
