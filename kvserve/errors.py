"""Typed errors raised at every boundary a user can reach."""


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class InvalidRequestError(KVServeError, ValueError):
    """A request (prompt or sampling parameters) is invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """The prompt plus the tokens asked for cannot fit in the model's context or the KV cache."""


class ModelLoadError(KVServeError):
    """A model path is missing, or a checkpoint is corrupt or unsupported."""


class EngineDeadError(KVServeError):
    """The engine loop failed and can no longer serve requests."""


class RequestFailedError(KVServeError):
    """The engine step running this request failed; the request was aborted and the engine goes on."""


class LoRAError(InvalidRequestError):
    """A LoRA adapter is missing, corrupt, unsupported, too large for the engine's limits, or not for this model."""

    def __init__(self, message: str, param: str | None = "lora_request"):
        super().__init__(message, param)
