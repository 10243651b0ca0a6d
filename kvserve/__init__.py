"""kvserve: a high-throughput, memory-efficient LLM inference and serving engine."""
from kvserve.config import EngineConfig
from kvserve.errors import ContextLengthExceededError, InvalidRequestError, KVServeError, LoRAError, ModelLoadError
from kvserve.lora import LoRARequest
from kvserve.outputs import (CompletionOutput, EmbeddingRequestOutput, Logprob, PoolingRequestOutput, RequestOutput,
                             ScoringRequestOutput)
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "ContextLengthExceededError", "EmbeddingRequestOutput", "EngineConfig",
           "InvalidRequestError", "KVServeError", "Logprob", "LoRAError", "LoRARequest", "ModelLoadError",
           "PoolingParams", "PoolingRequestOutput", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "ScoringRequestOutput", "__version__"]


def __getattr__(name):
    # LLM pulls in torch, the model code and the tokenizer stack: load it only when asked for
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM
        return LLM
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
