"""Loading the draft model of speculative decoding beside its target, with the checks that keep it useful and its
requantized heads and layers (speculative_config draft_head_quantization, draft_quantization, draft_vocab_size)."""
from __future__ import annotations

import dataclasses
import logging

import torch

from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.model import load_model
from kvserve.spec_decode.config import auto_draft_vocab

logger = logging.getLogger("kvserve")


def load_draft_model(engine):
    """The draft model of speculative decoding (an LLMEngine's spec_config), loaded as its target is; refused unless
    it shares the target's vocabulary and is smaller."""
    spec = engine.spec_config
    cut = auto_draft_vocab(engine.vocab_size) if spec.draft_vocab_size == "auto" else spec.draft_vocab_size
    if cut is not None and cut > engine.vocab_size:
        raise InvalidRequestError(f"speculative_config: draft_vocab_size {cut} exceeds the "
                                  f"vocabulary ({engine.vocab_size} tokens)", "speculative_config")
    try:
        # "gguf" is the target file's: an HF draft beside a GGUF target loads dequantized
        quantization = "auto" if engine.config.quantization == "gguf" else engine.config.quantization
        draft, draft_config = load_model(dataclasses.replace(engine.config, model=spec.model, speculative_config=None,
                                                             quantization=quantization), fp16_linears=False)
    except KVServeError as e:
        raise InvalidRequestError(f"speculative_config: the draft model {spec.model!r} could not be loaded: {e}",
                                  "speculative_config") from e
    if draft_config.vocab_size != engine.vocab_size:
        raise InvalidRequestError(f"speculative_config: the draft model's vocabulary has {draft_config.vocab_size}"
                                  f" tokens, the target's {engine.vocab_size}: they must be the same",
                                  "speculative_config")
    # tensor-parallel: the target here is rank 0's shard (the largest), the draft runs whole on rank 0
    num_draft = _num_parameters(draft)
    num_target = _num_parameters(engine.model) * (engine.executor.size if engine.executor is not None else 1)
    if num_draft >= num_target:
        raise InvalidRequestError(f"speculative_config: the draft model ({num_draft:,} parameters) is not smaller "
                                  f"than the target ({num_target:,}): it would only slow decoding down",
                                  "speculative_config")
    stored = draft.head_format()
    if spec.draft_head_quantization == "q4_0" or (spec.draft_head_quantization == "auto"
                                                  and stored in ("Q8_0", "INT8")):
        try:
            draft.quantize_head_q4_0()
        except (ValueError, KVServeError) as e:
            raise InvalidRequestError(f"speculative_config: draft_head_quantization q4_0: {e}",
                                      "speculative_config") from None
        logger.info("kvserve: the draft model's output matrix requantized from %s to Q4_0 "
                    "(speculative_config draft_head_quantization)", stored or "its plain weights")
    if spec.draft_quantization is not None:
        try:
            formats = draft.quantize_layers_q4_0(stored_only=spec.draft_quantization == "auto")
        except (ValueError, KVServeError) as e:
            raise InvalidRequestError(f"speculative_config: draft_quantization {spec.draft_quantization}: {e}",
                                      "speculative_config") from None
        if formats:
            logger.info("kvserve: the draft model's layer matrices in %s requantized to Q4_0 (speculative_config "
                        "draft_quantization)", ", ".join(f"{k} x{v}" for k, v in sorted(formats.items())))
    if cut is not None and cut < engine.vocab_size:
        draft.restrict_vocab(cut)
        logger.info("kvserve: the draft model proposes among the first %d of %d token ids and each request's own "
                    "past them, the whole vocabulary for requests whose output brings new ones (speculative_config "
                    "draft_vocab_size %s)", cut, engine.vocab_size, spec.draft_vocab_size)
    return draft


def _num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
