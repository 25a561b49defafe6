"""The HTTP layer: FastAPI app, routes, OpenAI-shaped errors, API-key auth, and `run_server`."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Query
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import sluice
from sluice.config import EngineConfig, ServerConfig
from sluice.engine.async_engine import AsyncEngine
from sluice.engine.errors import EngineError
from sluice.server.lifecycle import (
    LifecycleMiddleware,
    Phase,
    ServerLifecycle,
    UvicornServer,
    fail_after_busy_steps,
    stall_after_busy_steps,
)
from sluice.server.metrics import CONTENT_TYPE, ServerMetrics
from sluice.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadInfo,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from sluice.server.serving_base import ClientDisconnected, api_error_from, parse_request, validation_error
from sluice.server.serving_chat import OpenAIServingChat
from sluice.server.serving_completion import OpenAIServingCompletion
from sluice.server.serving_messages import AnthropicServingMessages, CountTokensRequest, MessagesRequest, error_body
from sluice.server.serving_responses import OpenAIServingResponses
from sluice.server.serving_tokenize import OpenAIServingTokenization, tokenize_request_model

logger = logging.getLogger(__name__)

_CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away; nobody reads it


def served_model_name(model_path: str, server_config: ServerConfig) -> str:
    """`--served-model-name`, else the model file's stem or the model folder's name."""
    if server_config.served_model_name:
        return server_config.served_model_name
    path = Path(model_path.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def error_response(error: APIError, raw_request: Request) -> JSONResponse:
    """The error in OpenAI's shape, or in Anthropic's for its Messages API (/v1/messages...)."""
    return JSONResponse(error_body(error, raw_request.url.path), status_code=error.status_code, headers=error.headers)


async def read_json_body(raw_request: Request, max_bytes: int) -> Any:
    """The request body parsed as JSON; 413 above `max_bytes`, 400 if it is not JSON."""
    too_large = APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
    declared = raw_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in raw_request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    _check_unicode(parsed)
    return parsed


def _check_unicode(value: Any) -> None:
    """JSON may escape lone UTF-16 surrogates (`"\\ud800"`), which no tokenizer can encode."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"the request body has a string that is not valid Unicode: {e.reason}",
                               code="invalid_json") from e
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _bearer_auth(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode()

    async def require_api_key(raw_request: Request) -> None:
        scheme, _, token = raw_request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":   # Anthropic's clients send the key as x-api-key
            token = raw_request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(
                401, "invalid or missing API key; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key"
            )

    return require_api_key


LOAD_WAIT_MAX_S = 30.0   # the longest `GET /load?wait=` holds an answer
LOAD_WAIT_TICK_S = 0.02  # how often a held `/load` looks at the engine's stats (in process, no HTTP)
LOAD_PENDING_MAX_CHARS = 16384   # `GET /load?pending=`: a router's admissions in transit
# The most a request's line and headers may take. uvicorn's HTTP parser (h11) answers a head it has
# buffered past 16 KiB with a bare text/plain 400 before the app sees it (or the client gets a
# broken pipe), so a `pending` within its documented bound, 12 URL characters for each 4-byte
# character, was refused by how the bytes happened to arrive (the schema fuzz found it).
MAX_REQUEST_HEAD_BYTES = 12 * LOAD_PENDING_MAX_CHARS + 64 * 1024


def _install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(raw_request: Request, exc: Exception) -> Response:
        return error_response(api_error_from(exc), raw_request)

    async def on_validation_error(raw_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc), raw_request)

    async def on_http_error(raw_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})), raw_request)

    async def on_client_disconnected(_: Request, exc: Exception) -> Response:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)

    async def on_unexpected(raw_request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(api_error_from(exc), raw_request)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(EngineError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnected, on_client_disconnected)
    app.add_exception_handler(Exception, on_unexpected)


def build_app(
    engine: AsyncEngine, server_config: ServerConfig, lifecycle: Optional[ServerLifecycle] = None
) -> FastAPI:
    """The OpenAI-compatible app around `engine`. The app owns the engine's lifecycle: its lifespan
    starts the engine loop and the `lifecycle` supervisor, and shuts both down."""
    model_name = served_model_name(engine.config.model_path, server_config)
    max_model_len = engine.config.scheduler.max_model_len
    metrics = ServerMetrics(engine.stats, model_name)
    chat = OpenAIServingChat(engine, server_config, model_name, metrics)
    completion = OpenAIServingCompletion(engine, server_config, model_name, metrics)
    tokenization = OpenAIServingTokenization(engine, server_config, model_name, metrics)
    responses = OpenAIServingResponses(engine, server_config, model_name, metrics,
                                       store_size=server_config.responses_store_size)
    messages = AnthropicServingMessages(engine, server_config, model_name, metrics)
    lifecycle = lifecycle or ServerLifecycle(engine, server_config.shutdown_timeout_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        supervisor = asyncio.create_task(lifecycle.supervise())
        logger.info("serving %s (max_model_len %d)", model_name, max_model_len)
        try:
            yield
        finally:
            supervisor.cancel()
            await engine.shutdown()

    app = FastAPI(title="sluice", lifespan=lifespan, docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    app.add_middleware(LifecycleMiddleware, lifecycle=lifecycle)
    _document_request_bodies(app)
    auth = [Depends(_bearer_auth(server_config.api_key))] if server_config.api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=auth)

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, root=engine.config.model_path, max_model_len=max_model_len)

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        chat.check_model(model_id)
        return model_card()

    @v1.post("/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def create_chat_completion(raw_request: Request) -> Response:
        body = await read_json_body(raw_request, server_config.max_request_bytes)
        request = parse_request(ChatCompletionRequest, body)
        return await chat.create_chat_completion(request, raw_request)

    @v1.post("/completions", openapi_extra=_json_body(CompletionRequest))
    async def create_completion(raw_request: Request) -> Response:
        body = await read_json_body(raw_request, server_config.max_request_bytes)
        request = parse_request(CompletionRequest, body)
        return await completion.create_completion(request, raw_request)

    @v1.post("/responses", openapi_extra=_json_body(ResponsesRequest))
    async def create_response(raw_request: Request) -> Response:
        body = await read_json_body(raw_request, server_config.max_request_bytes)
        request = parse_request(ResponsesRequest, body)
        return await responses.create_response(request, raw_request)

    @v1.post("/messages", openapi_extra=_json_body(MessagesRequest))
    async def create_message(raw_request: Request) -> Response:
        body = await read_json_body(raw_request, server_config.max_request_bytes)
        request = parse_request(MessagesRequest, body)
        return await messages.create_message(request, raw_request)

    @v1.post("/messages/count_tokens", openapi_extra=_json_body(CountTokensRequest))
    async def count_message_tokens(raw_request: Request) -> Response:
        body = await read_json_body(raw_request, server_config.max_request_bytes)
        return JSONResponse(await messages.count_tokens(parse_request(CountTokensRequest, body)))

    @v1.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return JSONResponse(responses.retrieve(response_id))

    @v1.get("/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, after: Optional[str] = None, limit: Optional[int] = None,
                               order: Optional[str] = None, include: Optional[list[str]] = Query(None)) -> Response:
        return JSONResponse(responses.input_items(response_id, after, limit, order, include))

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return JSONResponse(responses.delete(response_id))

    app.include_router(v1)

    # vLLM serves these at the root, beside /v1; behind the API key like /v1 when one is set.
    @app.post("/tokenize", dependencies=auth,
              openapi_extra=_json_body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(raw_request: Request) -> TokenizeResponse:
        body = await read_json_body(raw_request, server_config.max_request_bytes)
        return tokenization.tokenize(parse_request(tokenize_request_model(body), body))

    @app.post("/detokenize", dependencies=auth, openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(raw_request: Request) -> DetokenizeResponse:
        body = await read_json_body(raw_request, server_config.max_request_bytes)
        return tokenization.detokenize(parse_request(DetokenizeRequest, body))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 while serving; 503 while draining for shutdown or once the engine has failed.
        HEAD answers the same without a body (load balancers' probes)."""
        phase = lifecycle.phase if engine.is_healthy else Phase.DEAD
        return JSONResponse({"status": phase.value}, status_code=200 if phase is Phase.SERVING else 503)

    # vLLM's /ping (SageMaker's health probe, GET or POST): the same answer as /health.
    app.add_api_route("/ping", health, methods=["GET", "POST", "HEAD"])

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The server's version, as vLLM's `GET /version` answers (open, like /health)."""
        return {"version": sluice.__version__}

    def load_info(pending: frozenset[str]) -> LoadInfo:
        s = engine.stats()
        return LoadInfo(
            running=s.num_running, waiting=s.num_waiting, waiting_tokens=s.num_waiting_tokens,
            kv_usage=s.kv_usage, accepting=s.accepting and lifecycle.accepting,
            admissible_workflows=s.admissible_workflows if lifecycle.accepting else 0,
            active_workflows=s.active_workflows, max_active_workflows=s.max_active_workflows,
            pending_counted=len(pending & s.active_workflow_ids) if pending else None,
        )

    @app.get("/load")
    async def load(wait: float = Query(0.0, ge=0.0, le=LOAD_WAIT_MAX_S),
                   pending: str = Query("", max_length=LOAD_PENDING_MAX_CHARS)) -> LoadInfo:
        """The engine's load now. `pending`: comma-separated ids of workflows the caller (a router)
        admitted whose calls may not have reached the server yet; `pending_counted` says how many
        of them it counts already, so the room left is admissible_workflows less the others.
        `wait` (seconds): a long poll; the answer comes as soon as there is that room, the server
        stops accepting (draining) or its engine fails, or `wait` has passed. A router waiting
        for room then asks about once per admission instead of many times a second (each answer
        is CPU the engine does not get: docs/benchmarks.md, session 43)."""
        ids = frozenset(p for p in pending.split(",") if p)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            info = load_info(ids)
            left = deadline - loop.time()
            room = info.admissible_workflows - (len(ids) - (info.pending_counted or 0))
            if room >= 1 or left <= 0 or not lifecycle.accepting or not engine.is_healthy:
                return info
            await asyncio.sleep(min(LOAD_WAIT_TICK_S, left))

    metrics_auth = auth if server_config.metrics_require_auth else []

    @app.get("/metrics", dependencies=metrics_auth)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a route that parses its body itself (to bound its size): one
    of `models`."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_request_bodies(app: FastAPI) -> None:
    """Adds the request models that `_json_body` refers to to the app's OpenAPI components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = generate()
            _, defs = models_json_schema(
                [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation"),
                 (ResponsesRequest, "validation"), (TokenizeCompletionRequest, "validation"),
                 (TokenizeChatRequest, "validation"), (DetokenizeRequest, "validation")],
                ref_template="#/components/schemas/{model}",
            )
            spec.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_UVICORN_GRACE_S = 2.0  # after the lifecycle's own wait: connections still open are then cut


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Load the engine and serve until drained (SIGTERM/SIGINT: 0) or the engine fails (1)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(engine_config)
    if server_config.fault_inject_after_steps is not None:
        engine.step_hook = fail_after_busy_steps(engine, server_config.fault_inject_after_steps)
    if server_config.fault_inject_stall_after_steps is not None:
        stall_after_busy_steps(engine, server_config.fault_inject_stall_after_steps)
    lifecycle = ServerLifecycle(engine, server_config.shutdown_timeout_s)
    app = build_app(engine, server_config, lifecycle)
    server = UvicornServer(uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        lifespan="on",
        access_log=server_config.log_requests,
        timeout_graceful_shutdown=_UVICORN_GRACE_S,
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
    ), lifecycle)
    server.run()
    if not server.started:
        return 1
    logger.info("exiting with status %d", lifecycle.exit_code)
    return lifecycle.exit_code
