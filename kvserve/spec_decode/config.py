"""SpeculativeConfig: which proposer guesses the next tokens, and how many (vLLM's `speculative_config` shape)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidRequestError
from kvserve.json_options import json_object

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPEC_FACTOR = 64   # a match of one token then allows any k (num_speculative_tokens is at most 64)
DRAFT_QUANTIZATIONS = ("auto", "q4_0", None)   # draft_head_quantization, draft_quantization
AUTO_DRAFT_VOCAB = 32768   # draft_vocab_size "auto"'s cut (auto_draft_vocab)
PARAM = "speculative_config"


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings; build with `SpeculativeConfig.parse(dict | JSON text | None)`."""

    method: str
    num_speculative_tokens: int
    model: str | None = None             # draft_model: the draft checkpoint (HF directory or .gguf)
    # draft_model: the draft proposes among the first N token ids (a BPE vocabulary puts its frequent tokens first)
    # and each request's own tokens past them, computing logits for those rows of its output matrix only, except for
    # a request whose output keeps bringing new tokens past them (spec_decode.draft_vocab); verification keeps the
    # output exact. "auto": AUTO_DRAFT_VOCAB where the vocabulary is more than twice as large (auto_draft_vocab),
    # else the whole; None: the whole vocabulary
    draft_vocab_size: int | str | None = "auto"
    # draft_model: the draft's output matrix requantized to Q4_0 at load ("q4_0"), or kept as stored (None);
    # "auto": requantized where it is stored in 8 bits (Q8_0, --quantization int8's INT8). Its logits only choose
    # the proposals, which verification checks: the output stays exact (docs/speculative_decoding.md)
    draft_head_quantization: str | None = "auto"
    # draft_model: the draft's decoder-layer linears requantized to Q4_0 at load ("q4_0": all; "auto": those stored
    # quantized in more bits a weight, Q5_0, Q6_K, Q8_0, INT8...), or kept as stored (None); the output stays exact
    draft_quantization: str | None = "auto"
    prompt_lookup_min: int = 2           # ngram: shortest suffix n-gram looked up in the sequence
    prompt_lookup_max: int = 5           # ngram: longest
    suffix_max_tree_depth: int = 24      # suffix: longest context matched, and the trees' depth
    suffix_max_cached_requests: int = 1000   # suffix: finished requests whose outputs the global tree keeps
    suffix_min_token_prob: float = 0.1   # suffix: a draft stops where its estimated probability falls below this
    # no drafts in a step with more running requests than this: a big batch is compute-bound, and verifying
    # k + 1 tokens per request then costs about k + 1 decodes (benchmarks/LOG.md measures the threshold)
    disable_by_batch_size: int | None = 8
    # ngram and suffix: a draft is at most this many times as long as the context it matched (vLLM's
    # suffix_decoding_max_spec_factor); None: up to num_speculative_tokens whatever the match
    max_spec_factor: float | None = 1.0
    # per request, at most as many drafts as the last verification accepted plus one after a rejection, one more
    # after each verification that accepted all (up to num_speculative_tokens): a run of rejections costs few
    # verified rows where each row costs compute (docs/speculative_decoding.md). None: on for draft_model; off
    # for ngram and suffix, whose drafts max_spec_factor sizes by their match
    adaptive_draft_length: bool | None = None

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a dict, a JSON object text or a SpeculativeConfig; None stays None (no speculation)."""
        if value is None:
            return value
        if isinstance(value, cls):   # built directly: checked, and its method's defaults filled in, here too
            value.validate()
            return value
        value = json_object(value, cls, PARAM)
        if value.get("method") is None:   # vLLM infers it: a draft model when one is named
            value["method"] = "draft_model" if value.get("model") else None
        if value["method"] is None:
            raise InvalidRequestError(f"speculative_config needs a method ({', '.join(METHODS)}) or a draft model",
                                      PARAM)
        if "num_speculative_tokens" not in value:
            raise InvalidRequestError("speculative_config needs num_speculative_tokens", PARAM)
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        def bad(msg):
            raise InvalidRequestError(f"speculative_config: {msg}", PARAM)
        if self.method not in METHODS:
            bad(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if not _is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 64:
            bad(f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}")
        if self.method == "draft_model" and not self.model:
            bad("method draft_model needs a model (the draft checkpoint)")
        if self.method != "draft_model" and self.model:
            bad(f"method {self.method} takes no model")
        if self.draft_vocab_size not in (None, "auto"):
            if self.method != "draft_model":
                bad(f"draft_vocab_size applies to method draft_model only, not {self.method}")
            if not _is_int(self.draft_vocab_size) or self.draft_vocab_size < 1:
                bad(f'draft_vocab_size must be an integer >= 1, "auto" or null, got {self.draft_vocab_size!r}')
        for key in ("draft_head_quantization", "draft_quantization"):
            value = getattr(self, key)
            if value not in DRAFT_QUANTIZATIONS:
                bad(f'{key} must be "auto", "q4_0" or null, got {value!r}')
            if value == "q4_0" and self.method != "draft_model":
                bad(f"{key} applies to method draft_model only, not {self.method}")
        if not (_is_int(self.prompt_lookup_min) and _is_int(self.prompt_lookup_max)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            bad("prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, got "
                f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
        if not _is_int(self.suffix_max_tree_depth) or self.suffix_max_tree_depth < 2:
            bad(f"suffix_max_tree_depth must be an integer >= 2, got {self.suffix_max_tree_depth!r}")
        if not _is_int(self.suffix_max_cached_requests) or self.suffix_max_cached_requests < 0:
            bad(f"suffix_max_cached_requests must be an integer >= 0, got {self.suffix_max_cached_requests!r}")
        if not isinstance(self.suffix_min_token_prob, (int, float)) or not 0 <= self.suffix_min_token_prob <= 1:
            bad(f"suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob!r}")
        if not is_spec_factor(self.max_spec_factor):
            bad(f"max_spec_factor must be a number in (0, {MAX_SPEC_FACTOR}] or null, got {self.max_spec_factor!r}")
        if self.adaptive_draft_length is None:
            self.adaptive_draft_length = self.method == "draft_model"
        if not isinstance(self.adaptive_draft_length, bool):
            bad(f"adaptive_draft_length must be true, false or null, got {self.adaptive_draft_length!r}")
        if self.disable_by_batch_size is not None and (not _is_int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 1):
            bad(f"disable_by_batch_size must be an integer >= 1 or null, got {self.disable_by_batch_size!r}")

    def is_enabled_for(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests proposes drafts."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size


def auto_draft_vocab(vocab_size: int) -> int | None:
    """draft_vocab_size "auto"'s cut for a vocabulary of `vocab_size` tokens: AUTO_DRAFT_VOCAB where the vocabulary
    is more than twice as large (its output matrix then a large share of a small draft's bytes), else None."""
    return AUTO_DRAFT_VOCAB if vocab_size > 2 * AUTO_DRAFT_VOCAB else None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_spec_factor(x) -> bool:
    """Whether x is a valid max_spec_factor: None, or a number in (0, MAX_SPEC_FACTOR]."""
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= MAX_SPEC_FACTOR)


def spec_len(max_spec_factor: float, match_len: int) -> int:
    """The most draft tokens a match of `match_len` tokens allows (max_spec_factor x match_len, rounded down; the
    epsilon keeps 0.1 x 30 at 3)."""
    return int(max_spec_factor * match_len + 1e-9)
