"""The engine's side of pooling requests (LLM.embed, /v1/embeddings): their parameters resolved against the
model, the checks a prompt must pass, and the output a finished one becomes."""
from __future__ import annotations

from kvserve.core.request import Request
from kvserve.errors import ContextLengthExceededError, InvalidRequestError
from kvserve.model.model_config import ModelConfig
from kvserve.outputs import PoolingOutput, PoolingRequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.worker.pooling import PoolingState


def pooling_state(params: PoolingParams | None, cfg: ModelConfig, is_encoder: bool) -> PoolingState:
    """The request's PoolingState: its own choices, else the checkpoint's (sentence-transformers files), else CLS
    for an encoder and LAST for a decoder; normalized unless asked not to be."""
    params = params if params is not None else PoolingParams()
    if not isinstance(params, PoolingParams):
        raise InvalidRequestError(f"pooling_params must be a PoolingParams, got {type(params).__name__}",
                                  "pooling_params")
    params.validate(cfg.hidden_size)
    kind = params.pooling_type or cfg.pooling_type or ("CLS" if is_encoder else "LAST")
    normalize = cfg.pooling_normalize if params.normalize is None else params.normalize
    return PoolingState(kind.upper(), normalize, params.dimensions, whole=is_encoder)


def check_pooling_fits(num_prompt: int, max_model_len: int, num_pool_tokens: int, step_tokens: int,
                       is_encoder: bool) -> None:
    """A pooling prompt computes no output token: it must fit the context, the KV pool, and for an encoder (its
    sequence whole in one step) the step's token budget."""
    limits = [(max_model_len, "this model's maximum context length"), (num_pool_tokens, "the KV cache")]
    if is_encoder:
        limits.append((step_tokens, "max_num_batched_tokens (an encoder's sequence runs in one step)"))
    for limit, what in limits:
        if num_prompt > limit:
            raise ContextLengthExceededError(f"the input has {num_prompt} tokens, more than {what} ({limit} "
                                             "tokens)", "input")


def refuse_generation(architecture: str, is_encoder: bool) -> InvalidRequestError:
    """The error of a generation request on an engine that only pools."""
    what = f"{architecture} is an encoder" if is_encoder else "this engine runs with runner='pooling'"
    return InvalidRequestError(f"{what}: it embeds (LLM.embed, POST /v1/embeddings) and does not generate text",
                               "model")


def pooling_output(request_id: str, prompt: str | None, req: Request, finished: bool,
                   metrics: dict) -> PoolingRequestOutput:
    return PoolingRequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=req.prompt_token_ids,
                                outputs=PoolingOutput(req.pooling.embedding), finished=finished,
                                num_cached_tokens=max(req.num_cached_tokens, 0), metrics=metrics)
