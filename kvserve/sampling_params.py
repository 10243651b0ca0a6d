"""SamplingParams: per-request generation settings, validated on construction (vLLM's names)."""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from kvserve.errors import InvalidRequestError

_MAX_LOGPROBS = 20
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1   # what torch.Generator.manual_seed takes
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0   # every output carries everything generated so far
    DELTA = 1        # every output carries only what is new since the last one
    FINAL_ONLY = 2   # one output, when the request finishes


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names): a JSON schema, a regex, a choice among strings, an EBNF
    grammar, or any JSON object. Exactly one is set."""

    json: dict | str | None = None      # a JSON schema (dict, JSON text or a pydantic model class)
    regex: str | None = None            # the whole output matches it
    choice: list[str] | None = None     # the output is one of these strings
    grammar: str | None = None          # EBNF (xgrammar / GBNF syntax), root rule `root`
    json_object: bool | None = None     # any JSON object
    disable_any_whitespace: bool = False   # JSON without free whitespace: compact output, fewer tokens
    # equal for equal constraints: the grammar cache's key, serialized once here (the engine asks for it per sample)
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()   # a pydantic model class
        set_ = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError("structured_outputs must set exactly one of json, regex, choice, grammar or "
                                      f"json_object, got {', '.join(set_) if set_ else 'none'}", "structured_outputs")
        self._verify(set_[0])
        try:
            self.key = self._make_key()
        except RecursionError:
            raise InvalidRequestError("structured_outputs is nested too deeply", "structured_outputs") from None

    def _verify(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}",
                                              "structured_outputs") from None
                except RecursionError:
                    raise InvalidRequestError("structured_outputs.json is nested too deeply",
                                              "structured_outputs") from None
            if not isinstance(self.json, (dict, bool)):
                raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object), got "
                                          f"{type(self.json).__name__}", "structured_outputs")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or \
                    not all(isinstance(c, str) and c for c in value):
                raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                          "structured_outputs")
            self.choice = list(value)
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequestError("structured_outputs.json_object must be true", "structured_outputs")
        elif not isinstance(value, str) or not value:
            raise InvalidRequestError(f"structured_outputs.{kind} must be a non-empty string", "structured_outputs")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("structured_outputs.disable_any_whitespace must be a boolean",
                                      "structured_outputs")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def _make_key(self) -> tuple:
        value: Any = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            value = json.dumps(value, sort_keys=True, ensure_ascii=False)
        return self.kind, value, self.disable_any_whitespace

    @classmethod
    def from_value(cls, value) -> "StructuredOutputsParams | None":
        """A StructuredOutputsParams from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError("structured_outputs must be an object with one of json, regex, choice, "
                                      "grammar or json_object", "structured_outputs")
        unknown = sorted(set(value) - {f.name for f in fields(cls) if f.init})
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown fields: {', '.join(unknown)}",
                                      "structured_outputs")
        return cls(**value)


@dataclass
class SamplingParams:
    """How to sample one request; greedy when temperature == 0."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16     # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None          # top-k logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None   # top-k logprobs per prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | dict | None = None   # constrained decoding (docs/structured_outputs.md)
    allowed_token_ids: list[int] | None = None   # sample only among these tokens
    bad_words: list[str] | None = None   # never generate these words (the last token of each, once its others came)
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens; -1: all that leave max_tokens
    # filled by the engine, not by users
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    allowed_ids: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)   # sorted, unique

    def __post_init__(self):
        self._verify_numbers()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (list, tuple)):
                raise InvalidRequestError(f"{name} must be a list, got {getattr(self, name)!r}", name)
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}",
                                      "logit_bias")
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias") from None
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature is not None and 0 < self.temperature < 1e-5:
            self.temperature = 0.0
        self.bad_words = list(self.bad_words or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._verify()
        if self.allowed_token_ids is not None:   # built once: each step's mask takes it as it is
            self.allowed_ids = np.unique(np.asarray(self.allowed_token_ids, dtype=np.int64))
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        for name in ("allowed_token_ids", "bad_words"):   # a ban could leave a grammar's only token forbidden
            if self.structured_outputs is not None and getattr(self, name):
                raise InvalidRequestError(f"{name} cannot be combined with structured outputs (the grammar chooses "
                                          "the allowed tokens)", name)
        self.all_stop_token_ids = set(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def sample_seed(self, index: int) -> int | None:
        """The seed of the index-th of n samples: seed + index, wrapped to stay in 64 bits."""
        if self.seed is None:
            return None
        seed = self.seed + index
        return seed - 2**64 if seed > MAX_SEED else seed

    def _verify_numbers(self) -> None:
        """The float fields are finite numbers (no NaN or infinity, which every range check below lets through)."""
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not is_finite_number(v):
                raise InvalidRequestError(f"{name} must be a finite number, got {v!r}", name)
        if isinstance(self.logit_bias, dict) and not all(map(is_finite_number, self.logit_bias.values())):
            raise InvalidRequestError("logit_bias values must be finite numbers", "logit_bias")

    def _verify(self) -> None:
        def bad(msg: str, param: str):
            raise InvalidRequestError(msg, param)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}", "n")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not is_int(self.top_k) or self.top_k < 0:
            bad(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}", "presence_penalty")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}", "frequency_penalty")
        if not 0 < self.repetition_penalty <= 2:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}", "repetition_penalty")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be at least 1, got {self.max_tokens!r}", "max_tokens")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        if self.seed is not None and (not is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            bad(f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}] (64 bits), got {self.seed!r}", "seed")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= _MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {_MAX_LOGPROBS}], got {v!r}", name)
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings", "stop")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers", "stop_token_ids")
        if self.logit_bias and any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            bad("logit_bias values must be in [-100, 100]", "logit_bias")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids must be a non-empty list of non-negative integers", "allowed_token_ids")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words must be a list of non-empty strings", "bad_words")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    def verify_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids in range."""
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise InvalidRequestError(f"{name} has token id {t} outside the vocabulary [0, {vocab_size})",
                                              name)


def check_truncate_prompt_tokens(k) -> None:
    """truncate_prompt_tokens (SamplingParams', PoolingParams'): None, a positive integer, or -1 (as many as fit)."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
        raise InvalidRequestError(f"truncate_prompt_tokens must be a positive integer or -1 (as many as fit), got "
                                  f"{k!r}", "truncate_prompt_tokens")


def is_finite_number(v) -> bool:
    """An int or float (not a bool) that is neither NaN nor infinite."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


SAMPLING_PARAM_NAMES = tuple(f.name for f in fields(SamplingParams) if f.name != "all_stop_token_ids")
