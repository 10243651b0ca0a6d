"""`kvserve proxy`: disaggregated prefill/decode in front of kvserve instances that share a KV connector.

    client -> proxy -> prefill instance (kv_producer): the request with max_tokens 1; its prompt's KV is saved
                    -> decode instance (kv_consumer): the request itself, streamed back; its prompt's KV is loaded

Each request's prefill goes to the next prefill URL and its decode to the next decode URL (round robin). A prefill
that fails costs only time: the decode instance computes what it does not find. A decode instance that cannot be
reached is skipped for the next one; one that fails while streaming ends that stream with an error event naming
the request, and the proxy goes on serving the others. A request the prefill instance refuses (4xx) is answered
with that refusal: the decode instance would refuse it too.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger("kvserve.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def error_body(message: str, status: int, kind: str = "server_error") -> dict:
    """An OpenAI error body."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def prefill_body(body: dict) -> dict:
    """The request as its prefill: one token, not streamed, one choice."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens", "n", "best_of")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


class DisaggregatedProxy:
    """The routes' state: the instances and one HTTP client."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], prefill_timeout_s: float = 600.0):
        if not prefill_urls or not decode_urls:
            raise ValueError("kvserve proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        # no cap on connections: each stream holds one for its whole length
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.prefill_timeout = httpx.Timeout(prefill_timeout_s, connect=10.0)
        self.num_prefill_failures = 0

    async def prefill(self, path: str, body: dict, headers: dict, request_id: str) -> Response | None:
        """Run the prefill; the instance's refusal of a bad request (4xx) as the answer, else None."""
        url = next(self._prefill)
        try:
            r = await self.client.post(url + path, json=prefill_body(body), headers=headers,
                                       timeout=self.prefill_timeout)
        except httpx.HTTPError as e:
            self.num_prefill_failures += 1
            logger.warning("kvserve proxy: request %s: the prefill instance %s failed (%s: %s); the decode instance "
                           "computes the prompt", request_id, url, type(e).__name__, e)
            return None
        if 400 <= r.status_code < 500 and r.status_code != 429:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        if r.status_code != 200:
            self.num_prefill_failures += 1
            logger.warning("kvserve proxy: request %s: the prefill instance %s answered %d; the decode instance "
                           "computes the prompt", request_id, url, r.status_code)
        return None

    async def decode(self, path: str, body: dict, headers: dict, request_id: str) -> Response:
        """Send the request to the first decode instance that takes it; stream its answer back."""
        errors = []
        for _ in range(len(self.decode_urls)):
            url = next(self._decode)
            try:
                upstream = await self.client.send(self.client.build_request("POST", url + path, json=body,
                                                                            headers=headers), stream=True)
            except httpx.HTTPError as e:
                errors.append(f"{url}: {type(e).__name__}: {e}")
                logger.warning("kvserve proxy: request %s: the decode instance %s cannot be reached: %s", request_id,
                               url, e)
                continue
            response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
            if not body.get("stream") or upstream.status_code != 200:
                try:
                    content = await upstream.aread()
                except httpx.HTTPError as e:
                    return self._failed(request_id, url, e)
                finally:
                    await upstream.aclose()
                return Response(content, upstream.status_code, response_headers)
            return StreamingResponse(self._relay(upstream, url, request_id), headers=response_headers,
                                     background=BackgroundTask(upstream.aclose))   # also if the relay never starts
        return JSONResponse(error_body(f"request {request_id}: no decode instance could be reached: "
                                       f"{'; '.join(errors)}", 502), 502)

    @staticmethod
    def _failed(request_id: str, url: str, e: Exception) -> JSONResponse:
        logger.warning("kvserve proxy: request %s: the decode instance %s failed: %s", request_id, url, e)
        return JSONResponse(error_body(f"request {request_id}: the decode instance {url} failed: "
                                       f"{type(e).__name__}: {e}", 502), 502)

    async def _relay(self, upstream: httpx.Response, url: str, request_id: str):
        """The decode instance's events, whole, as they come; a stream cut before [DONE] ends with an error event
        (the cut event's part is dropped, so a client parses every event it gets)."""
        done, pending = False, b""
        try:
            async for chunk in upstream.aiter_bytes():
                pending += chunk
                end = pending.rfind(b"\n\n") + 2
                if end >= 2:
                    events = pending[:end].split(b"\n\n")
                    done = done or any(e.strip() == b"data: [DONE]" for e in events)
                    yield pending[:end]
                    pending = pending[end:]
            if not done:
                raise httpx.RemoteProtocolError("the stream ended before [DONE]")
        except httpx.HTTPError as e:
            logger.warning("kvserve proxy: request %s: the decode instance %s failed while streaming: %s",
                           request_id, url, e)
            body = error_body(f"request {request_id}: the decode instance {url} failed while streaming: "
                              f"{type(e).__name__}: {e}", 502)
            yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()


def build_app(proxy: DisaggregatedProxy) -> FastAPI:
    """The proxy's routes: completions and chat through prefill then decode, /v1/models, /health."""
    app = FastAPI(title="kvserve proxy")

    async def forward(request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return JSONResponse(error_body(f"the request body is not JSON: {e}", 400, "invalid_request_error"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the request body must be a JSON object", 400, "invalid_request_error"),
                                400)
        headers = {"x-request-id": request_id}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        refusal = await proxy.prefill(request.url.path, body, headers, request_id)
        if refusal is not None:
            return refusal
        return await proxy.decode(request.url.path, body, headers, request_id)

    for route in ROUTES:
        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for url in proxy.decode_urls:
            try:
                r = await proxy.client.get(url + "/v1/models", headers=headers)
            except httpx.HTTPError as e:
                logger.warning("kvserve proxy: /v1/models: the decode instance %s cannot be reached: %s", url, e)
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return JSONResponse(error_body("no decode instance could be reached", 502), 502)

    @app.get("/health")
    async def health() -> dict:
        return {"prefill": proxy.prefill_urls, "decode": proxy.decode_urls}

    return app


def add_proxy_arguments(p: argparse.ArgumentParser) -> None:
    """`kvserve proxy`'s flags."""
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill instance (kvserve serve with a kv_producer --kv-transfer-config); repeat for more")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode instance (kv_consumer, the same connector and model); repeat for more")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill-timeout", type=float, default=600.0,
                   help="seconds a prefill may take before the decode instance computes the prompt itself")


def run_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until interrupted."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    proxy = DisaggregatedProxy(args.prefill, args.decode, args.prefill_timeout)
    logger.info("kvserve proxy: prefill on %s, decode on %s; listening on http://%s:%d", ", ".join(args.prefill),
                ", ".join(args.decode), args.host, args.port)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")
    return 0
