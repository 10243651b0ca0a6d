"""ASGI middleware: API-key check on /v1 routes, and one access-log line per request with its request id."""
from __future__ import annotations

import hmac
import logging
import time

from kvserve.entrypoints.openai.errors import AuthenticationError, error_response

access_logger = logging.getLogger("kvserve.access")


class ApiKeyMiddleware:
    """Requires 'Authorization: Bearer <key>' on /v1/* (as vLLM does; /health, /metrics... stay open)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization")
        if auth is None:
            err = AuthenticationError("missing API key: send the header 'Authorization: Bearer <key>'", None,
                                      "missing_api_key")
        elif not hmac.compare_digest(auth, self.expected):
            err = AuthenticationError("invalid API key", None, "invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        await error_response(err)(scope, receive, send)


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
