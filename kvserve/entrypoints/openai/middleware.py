"""ASGI middleware: the API-key check, the request body size limit, and one access-log line per request."""
from __future__ import annotations

import hmac
import logging
import time
from urllib.parse import parse_qs

from kvserve.entrypoints.openai.errors import AuthenticationError, BadRequestError, PayloadTooLargeError, \
    error_response

access_logger = logging.getLogger("kvserve.access")

# routes that stay open with --api-key (as in vLLM): probes and monitoring; everything else needs the key
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class ApiKeyMiddleware:
    """Requires 'Authorization: Bearer <key>' on every route but OPEN_PATHS (admin routes included)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization")
        if auth is None and scope["path"].startswith("/dashboard"):   # a browser opens /dashboard?key=KEY
            key = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key")
            auth = f"Bearer {key[0]}".encode() if key else None
        if auth is None:
            err = AuthenticationError("missing API key: send the header 'Authorization: Bearer <key>'", None,
                                      "missing_api_key")
        elif not hmac.compare_digest(auth, self.expected):
            err = AuthenticationError("invalid API key", None, "invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        await error_response(err)(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a request body over `max_bytes`, before the body is read whole or parsed.

    A declared Content-Length is checked at once; a chunked body is read up to the limit here, then handed on."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await error_response(BadRequestError("Content-Length is not a number", None,
                                                            "invalid_header"))(scope, receive, send)
            if int(length) > self.max_bytes:
                return await error_response(self._too_large())(scope, receive, send)
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await error_response(self._too_large())(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                                    "(--max-request-body-size)", None, "request_too_large")


class AccessLogMiddleware:
    """Logs method, path, status, duration and request id of every HTTP request once it has been answered.

    Handlers put the request id in request.state; it is also sent back as the X-Request-Id header.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        start = time.perf_counter()
        status = 500   # what the client sees when the app fails before starting a response

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                request_id = state.get("request_id")
                if request_id:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._log(scope, state.get("request_id"), status, time.perf_counter() - start)

    @staticmethod
    def _log(scope, request_id: str | None, status: int, duration_s: float) -> None:
        client = scope.get("client")
        fields = {"request_id": request_id, "method": scope["method"], "path": scope["path"], "status": status,
                  "duration_ms": round(duration_s * 1000, 1), "client": f"{client[0]}:{client[1]}" if client else None}
        access_logger.info("%s %s %s %d %.1fms%s", fields["client"], fields["method"], fields["path"], status,
                           fields["duration_ms"], f" [{request_id}]" if request_id else "", extra=fields)
