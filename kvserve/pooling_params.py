"""PoolingParams: how a request's hidden states become one vector (vLLM's name and fields)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import check_truncate_prompt_tokens

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """pooling_type: LAST (the last token's hidden state), MEAN (over every token) or CLS (the first token's); None:
    the model's own (an embedding model's sentence-transformers configuration), else LAST. normalize: to unit length
    (None: yes). dimensions: keep the first N values (models trained for it, e.g. Matryoshka), normalized after."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None   # embed the input's last k tokens; -1: max_model_len of them

    def validate(self, hidden_size: int) -> None:
        if self.pooling_type is not None and self.pooling_type.upper() not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                                      f"{self.pooling_type!r}", "pooling_type")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}", "normalize")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= hidden_size):
            raise InvalidRequestError(f"dimensions must be an integer in [1, {hidden_size}] (this model's embedding "
                                      f"size), got {d!r}", "dimensions")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
