"""The OpenAI-compatible HTTP server: the FastAPI app, its routes, and `kvserve serve` (uvicorn, signals)."""
from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import __version__
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.metrics import EngineMetrics
from kvserve.entrypoints.chat_utils import render_chat
from kvserve.entrypoints.openai.errors import APIError, BadRequestError, ConflictError, InternalServerError, \
    NotFoundError, error_response, to_api_error
from kvserve.entrypoints.openai.serving_embedding import (EmbeddingRequest, OpenAIServingEmbedding, RerankRequest,
                                                          ScoreRequest)
from kvserve.entrypoints.openai.dashboard import page as dashboard_page
from kvserve.entrypoints.openai.dashboard import STATE_MAX_AGE_S, snapshot
from kvserve.entrypoints.openai.middleware import AccessLogMiddleware, ApiKeyMiddleware, BodySizeLimitMiddleware
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, \
    DetokenizeResponse, LoadLoRAAdapterRequest, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, \
    UnloadLoRAAdapterRequest
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kvserve.entrypoints.openai.serving_common import parse_body
from kvserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvserve.errors import InvalidRequestError
from kvserve.lora import LoRARequest

logger = logging.getLogger("kvserve.server")

Handler = Callable[..., Awaitable[Response]]


@dataclass
class ServerSettings:
    """What the HTTP layer needs besides the engine."""

    served_model_names: list[str]
    model_path: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int | None = None   # None: default_max_request_body_bytes(max_model_len)
    enable_auto_tool_choice: bool = False       # tool_choice "auto": parse tool calls out of the model's text
    tool_call_parser: str | None = None         # with which parser (tool_parsers.TOOL_PARSERS)
    enable_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter


def default_max_request_body_bytes(max_model_len: int) -> int:
    """4 MiB plus 32 bytes per context token: a full context as token ids or escaped text, with room to spare."""
    return (4 << 20) + 32 * max_model_len


def api_route(handler: Handler) -> Handler:
    """Turn any exception a handler raises into the OpenAI error response for it (the server keeps serving)."""
    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except Exception as e:
            return error_response(to_api_error(e))
    return wrapper


async def _until_disconnect(raw_request: Request, work: Awaitable[Response]) -> Response:
    """Await `work`, but cancel it (aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    done, pending = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)   # nobody reads it; nginx's "client closed request"


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan starts and stops the engine thread."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    _add_error_handlers(app)
    _add_openai_routes(app, engine, settings)
    _add_pooling_routes(app, engine, settings)
    _add_server_routes(app, engine, settings)
    _add_lora_routes(app, engine, settings)
    _add_body_schemas(app, (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                            LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, EmbeddingRequest, ScoreRequest,
                            RerankRequest))
    # each add_middleware wraps the ones before it: the access log sees every answer, the key is checked before a
    # body is read, and the size limit before the body is parsed
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes
                       or default_max_request_body_bytes(engine.engine.max_model_len))
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(AccessLogMiddleware)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(NotFoundError(f"no route {request.method} {request.url.path}", None, "not_found"))
        err = APIError(str(exc.detail), None, None, dict(exc.headers or {}))
        err.status_code, err.type = exc.status_code, "invalid_request_error"
        return error_response(err)


def _json_body(model_cls) -> dict:
    """openapi_extra declaring the route's JSON body: handlers parse it themselves (parse_body), so FastAPI
    would not know it; /docs and clients of /openapi.json (schemathesis, SDK generators) need it."""
    ref = {"$ref": f"#/components/schemas/{model_cls.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _add_body_schemas(app: FastAPI, models) -> None:
    """Put the request models (and the models inside them) into the OpenAPI schema's components."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schemas = FastAPI.openapi(app).setdefault("components", {}).setdefault("schemas", {})
            for model_cls in models:
                schema = model_cls.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model_cls.__name__] = schema
        return app.openapi_schema
    app.openapi = openapi


def _add_pooling_routes(app: FastAPI, engine: AsyncLLMEngine, settings: ServerSettings) -> None:
    """/v1/embeddings and vLLM's /pooling, /score, /rerank (serving_embedding.py)."""
    serving = OpenAIServingEmbedding(engine, settings.served_model_names)

    def route(path: str, request_type, create):
        @app.post(path, openapi_extra=_json_body(request_type))
        @api_route
        async def handler(raw_request: Request):
            req = await parse_body(raw_request, request_type)
            return await _until_disconnect(raw_request, create(req, raw_request))

    route("/v1/embeddings", EmbeddingRequest, serving.create_embedding)
    route("/pooling", EmbeddingRequest, lambda req, raw: serving.create_embedding(req, raw, kind="pooling"))
    for path in ("/score", "/v1/score"):
        route(path, ScoreRequest, serving.create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        route(path, RerankRequest, serving.create_rerank)


def _add_openai_routes(app: FastAPI, engine: AsyncLLMEngine, settings: ServerSettings) -> None:
    completions = OpenAIServingCompletion(engine, settings.served_model_names)
    chat = OpenAIServingChat(engine, settings.served_model_names, settings.tool_call_parser,
                             settings.enable_auto_tool_choice)

    async def respond(raw_request: Request, request_type, create):
        req = await parse_body(raw_request, request_type)
        if req.stream:
            return await create(req, raw_request)
        return await _until_disconnect(raw_request, create(req, raw_request))

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    @api_route
    async def create_completion(raw_request: Request):
        return await respond(raw_request, CompletionRequest, completions.create)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    @api_route
    async def create_chat_completion(raw_request: Request):
        return await respond(raw_request, ChatCompletionRequest, chat.create)

    def model_cards() -> list[ModelCard]:
        cards = [ModelCard(id=name, root=settings.model_path or name, max_model_len=completions.max_model_len)
                 for name in settings.served_model_names]
        loras = engine.engine.lora
        for lora in (list(loras.registry.values()) if loras is not None else []):
            cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path,
                                   parent=lora.base_model_name or settings.served_model_names[0],
                                   max_model_len=completions.max_model_len))
        return cards

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(ModelList(data=model_cards()).model_dump())

    @app.get("/v1/models/{model_id:path}")
    @api_route
    async def retrieve_model(model_id: str):
        for card in model_cards():
            if card.id == model_id:
                return JSONResponse(card.model_dump())
        completions.check_model(model_id)   # 404 naming the models served
        raise NotFoundError(f"the model {model_id!r} does not exist", "model", "model_not_found")

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    @api_route
    async def tokenize(raw_request: Request):
        req = await parse_body(raw_request, TokenizeRequest)
        completions.check_model(req.model)
        ids = _tokenize(engine.tokenizer, req)
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=completions.max_model_len,
                                             tokens=ids).model_dump())

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    @api_route
    async def detokenize(raw_request: Request):
        req = await parse_body(raw_request, DetokenizeRequest)
        completions.check_model(req.model)
        vocab = engine.engine.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise InvalidRequestError(f"tokens must be token ids in [0, {vocab})", "tokens")
        return JSONResponse(DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens)).model_dump())


def _tokenize(tokenizer, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise BadRequestError("give exactly one of prompt or messages", "prompt", "invalid_value")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return tokenizer.encode(req.prompt, add_special_tokens=add_special)
    text = render_chat(tokenizer, [m.model_dump(exclude_none=True) for m in req.messages], None,
                       req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    return tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))


def _add_server_routes(app: FastAPI, engine: AsyncLLMEngine, settings: ServerSettings) -> None:
    @app.get("/health")
    async def health():
        if engine.is_healthy:
            return Response(status_code=200)
        return error_response(InternalServerError("the engine is not running", None, "engine_dead"))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(await engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    @api_route
    async def reset_prefix_cache():
        if not await engine.call_engine(lambda e: e.reset_prefix_cache()):
            raise ConflictError("the prefix cache was not reset: KV blocks are in use by running requests; "
                                "retry when the server is idle", None, "engine_busy")
        return {"success": True}

    @app.get("/dashboard")
    async def dashboard():
        return HTMLResponse(dashboard_page())

    last = {"time": 0.0, "state": None}   # one snapshot serves every poll within STATE_MAX_AGE_S

    @app.get("/dashboard/state")
    @api_route
    async def dashboard_state():
        metrics = getattr(engine, "metrics", None)
        if not isinstance(metrics, EngineMetrics):
            raise NotFoundError("the dashboard shows one engine: not data-parallel replicas yet", None, "not_found")
        if time.monotonic() - last["time"] > STATE_MAX_AGE_S:   # the engine thread takes it between two steps
            name = settings.served_model_names[0]
            last["state"] = await engine.call_engine(lambda e: snapshot(e, metrics, name))
            last["time"] = time.monotonic()
        return JSONResponse(last["state"])


def _add_lora_routes(app: FastAPI, engine: AsyncLLMEngine, settings: ServerSettings) -> None:
    """vLLM's runtime adapter routes: on with --enable-runtime-lora-updating (and --enable-lora)."""
    def manager():
        if not settings.enable_runtime_lora_updating:
            raise BadRequestError("runtime LoRA updating is off: start the server with --enable-lora "
                                  "--enable-runtime-lora-updating", None, "lora_updating_disabled")
        if engine.engine.lora is None:
            raise BadRequestError("LoRA is not enabled: start the server with --enable-lora", None, "lora_disabled")
        return engine.engine.lora

    @app.post("/v1/load_lora_adapter", openapi_extra=_json_body(LoadLoRAAdapterRequest))
    @api_route
    async def load_lora_adapter(raw_request: Request):
        req = await parse_body(raw_request, LoadLoRAAdapterRequest)
        loras = manager()
        if req.lora_name in settings.served_model_names:
            raise BadRequestError(f"{req.lora_name!r} is the base model's name; choose another lora_name",
                                  "lora_name", "invalid_value")
        request = LoRARequest(req.lora_name, loras.next_id(), req.lora_path,
                              base_model_name=settings.served_model_names[0])
        await asyncio.to_thread(loras.register, request)   # reads the disk off the event loop and engine thread
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_json_body(UnloadLoRAAdapterRequest))
    @api_route
    async def unload_lora_adapter(raw_request: Request):
        req = await parse_body(raw_request, UnloadLoRAAdapterRequest)
        if manager().unregister(req.lora_name) is None:
            raise NotFoundError(f"no LoRA adapter named {req.lora_name!r} is loaded", "lora_name", "lora_not_found")
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")


# ----- kvserve serve -----
class _Server(uvicorn.Server):
    """uvicorn, plus: one 'ready' line once listening, and a drain of in-flight requests on SIGINT/SIGTERM."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, ready_line: Callable[[str, int], str],
                 grace_s: float):
        super().__init__(config)
        self.engine = engine
        self.ready_line = ready_line
        self.grace_s = grace_s

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(self.ready_line(host, port), flush=True)

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_shutdown(self.grace_s)
        super().handle_exit(sig, frame)


def run_server(engine: AsyncLLMEngine, settings: ServerSettings, host: str, port: int,
               shutdown_timeout_s: float = 30.0) -> int:
    """Serve until SIGINT/SIGTERM; in-flight requests get `shutdown_timeout_s` to finish, then are told why not."""
    app = build_app(engine, settings)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout_s + 5, timeout_keep_alive=30)
    llm = engine.engine

    def ready_line(bound_host: str, bound_port: int) -> str:
        name = settings.served_model_names[0]
        key = f' -H "Authorization: Bearer {settings.api_key}"' if settings.api_key else ""
        return (f"kvserve: ready at http://{bound_host}:{bound_port} serving {name!r} "
                f"({str(llm.dtype).removeprefix('torch.')}{llm.parallel_description()}, KV cache {llm.num_kv_blocks} blocks x {llm.block_size} "
                f"tokens = {llm.num_kv_blocks * llm.block_size} tokens{llm.kv_cache_description()}, "
                f"max_model_len {llm.max_model_len})\n"
                f"kernels: {llm.kernel_summary}\n"
                f"weights: {llm.weights_summary}\n"
                + (f"LoRA: {llm.lora_description()}; adapters: {', '.join(sorted(llm.lora.registry)) or 'none yet'}\n"
                   if llm.lora is not None else "") +
                (f"try: curl http://{bound_host}:{bound_port}/v1/embeddings -H 'Content-Type: application/json'"
                   f"{key} -d '{{\"model\": \"{name}\", \"input\": [\"Name three planets.\"]}}'"
                   if llm.is_encoder or llm.config.runner == "pooling" else
                   f"try: curl http://{bound_host}:{bound_port}/v1/chat/completions -H 'Content-Type: application/json'"
                   f"{key} -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
                   f"\"content\": \"Name three planets.\"}}], \"max_tokens\": 32}}'"))

    server = _Server(config, engine, ready_line, shutdown_timeout_s)

    def engine_died():   # e.g. a tensor-parallel worker died: nothing can be served, so the server exits (status 1)
        server.should_exit = True
    engine.on_dead.append(engine_died)
    # uvicorn re-raises a caught signal once it has shut down; a no-op handler makes that a clean exit (status 0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    llm.shutdown()
    if engine.dead_error is not None:
        logger.error("kvserve: server stopped: the engine died (%s)", engine.dead_error)
        return 1
    logger.info("kvserve: server stopped")
    return 0 if server.started else 1
