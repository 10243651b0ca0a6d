"""HTTP errors of the OpenAI-compatible server, and the OpenAI error body they turn into."""
from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from kvserve.engine.async_engine import EngineOverloadedError, EngineStoppedError
from kvserve.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError, KVServeError, \
    RequestFailedError

logger = logging.getLogger("kvserve.server")


class APIError(KVServeError):
    """An error with an HTTP status, rendered as {"error": {"message", "type", "param", "code"}}."""

    status_code = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class BadRequestError(APIError):
    status_code = 400
    type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    type = "authentication_error"


class NotFoundError(APIError):
    status_code = 404
    type = "invalid_request_error"


class ConflictError(APIError):
    status_code = 409
    type = "invalid_request_error"


class PayloadTooLargeError(APIError):
    status_code = 413
    type = "invalid_request_error"


class ServiceUnavailableError(APIError):
    """The server cannot take the request now (queue full, shutting down); Retry-After says when to retry."""

    status_code = 503
    type = "service_unavailable_error"


class InternalServerError(APIError):
    status_code = 500
    type = "server_error"


def error_response(err: APIError) -> JSONResponse:
    """The JSON response for an APIError."""
    return JSONResponse(error_body(err), status_code=err.status_code, headers=err.headers)


def error_body(err: APIError) -> dict:
    return {"error": {"message": _encodable(err.message), "type": err.type, "param": _encodable(err.param),
                      "code": err.code}}


def _encodable(text: str | None) -> str | None:
    """Text as UTF-8 can carry it: a message quoting a lone surrogate from the request must not fail the answer."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def from_engine_error(err: InvalidRequestError) -> BadRequestError:
    """An engine validation error as a 400 that names the field."""
    code = "context_length_exceeded" if isinstance(err, ContextLengthExceededError) else "invalid_value"
    return BadRequestError(err.message, err.param, code)


def from_validation_error(err: ValidationError) -> BadRequestError:
    """A pydantic error as a 400 naming the first bad field: 'max_tokens: Input should be a valid integer'."""
    first = err.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    param = loc[0] if loc else None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return BadRequestError(f"missing required field {'.'.join(loc)!r}", param, "missing_required_parameter")
    where = ".".join(loc)
    got = first.get("input")
    suffix = "" if first["type"].startswith("value_error") else f" (got {_short_repr(got)})"
    return BadRequestError(f"{where}: {msg}{suffix}" if where else msg + suffix, param, "invalid_type")


def _is_union_tag(part) -> bool:
    # pydantic puts the union member it tried into loc ("str", "list[int]"); users know fields, not members
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _short_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def to_api_error(exc: BaseException) -> APIError:
    """Any exception as the APIError a client should see; unexpected ones are logged and become a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return from_engine_error(exc)
    if isinstance(exc, EngineOverloadedError):
        return ServiceUnavailableError(str(exc), None, "server_overloaded", {"Retry-After": _RETRY_AFTER_S})
    if isinstance(exc, EngineStoppedError):
        return ServiceUnavailableError(str(exc), None, "server_shutting_down", {"Retry-After": _RETRY_AFTER_S})
    if isinstance(exc, (EngineDeadError, RequestFailedError)):
        return InternalServerError(str(exc), None, "internal_error")
    logger.error("internal error while serving a request", exc_info=exc)
    return InternalServerError(f"internal error while serving this request: {type(exc).__name__}: {exc}", None,
                               "internal_error")


_RETRY_AFTER_S = "1"
