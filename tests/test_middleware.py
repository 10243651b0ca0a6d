"""The body size limit answers 413 before the app reads or parses anything; bodies under it reach the app whole."""
from __future__ import annotations

import asyncio
import json

from kvserve.entrypoints.openai.middleware import BodySizeLimitMiddleware

LIMIT = 100_000


def call(headers: list[tuple[bytes, bytes]], chunks: list[bytes]):
    """Run the middleware over one request; returns (status, body, receive() calls, what the app read)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    calls, sent, seen = [0], [], {"body": None}

    async def receive():
        calls[0] += 1
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(BodySizeLimitMiddleware(app, LIMIT)(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, calls[0], seen["body"]


def test_a_declared_length_over_the_limit_is_refused_without_reading_a_byte():
    status, body, calls, seen = call([(b"content-length", str(LIMIT + 1).encode())], [b"x" * (LIMIT + 1)])
    assert status == 413 and calls == 0 and seen is None
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit():
    chunks = [b"x" * 65536] * 10
    status, _, calls, seen = call([], chunks)
    assert status == 413 and seen is None and calls == 2   # 64 KiB, then 128 KiB > 100 kB: stop reading


def test_bodies_under_the_limit_reach_the_app_whole():
    assert call([(b"content-length", b"5")], [b"hello"])[::3] == (200, b"hello")
    assert call([], [b"ab", b"cd", b""])[::3] == (200, b"abcd")


def test_a_malformed_content_length_is_a_400():
    status, body, calls, _ = call([(b"content-length", b"12abc")], [b"x"])
    assert status == 400 and calls == 0 and json.loads(body)["error"]["code"] == "invalid_header"
