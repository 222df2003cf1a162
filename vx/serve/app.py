"""The OpenAI-compatible app: `build_app(llm, ...)` returns a FastAPI app serving one `vx.AsyncLLM`.

Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/embeddings` (behind the API key, if one is
set), and `/health`, `/metrics`, `/openapi.json` (open, for probes, scrapers and clients). The request guard
(guard.py) admits each request before any route runs; the app's lifespan starts the engine and stops it.
This module runs in the application's process: it never imports torch (the model lives in the engine process).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, AsyncIterator, Literal

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import vx
from vx.errors import EngineDeadError
from vx.serve.chat import create_chat_completion
from vx.serve.completions import create_completion
from vx.serve.embeddings import create_embeddings
from vx.serve.errors import APIError, install_error_handlers
from vx.serve.guard import GENERATION_PATHS, RequestGuard
from vx.serve.metrics import ServerMetrics
from vx.serve.openapi import openapi_document
from vx.serve.options import ServerOptions
from vx.serve.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                               EmbeddingRequest, EmbeddingResponse, ModelCard, ModelList)
from vx.serve.request_id import RequestIdMiddleware
from vx.serve.responses import create_response
from vx.serve.responses_protocol import ResponseObject, ResponsesRequest
from vx.serve.state import ServerState
from vx.serve.template_sandbox import TemplateLimits, TemplateSandbox

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 10.0  # how long /metrics waits for the engine's gauges
# How long /health waits for the engine's answer before it calls the engine busy (it answers between steps).
_HEALTH_TIMEOUT_S = 2.0


class HealthStatus(BaseModel):
    """What `GET /health` answers while the engine process lives: "ok" when it answered at once, "busy" when it
    is in a step that takes longer than a couple of seconds."""

    status: Literal["ok", "busy"] = "ok"


def build_app(llm: Any, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              chat_template: str | None = None, start_engine: bool = True,
              options: ServerOptions | None = None, trust_request_chat_template: bool = False,
              chat_template_limits: TemplateLimits | None = None, freeze_heap: bool = False) -> FastAPI:
    """A FastAPI app serving `llm` (a `vx.AsyncLLM`) under `served_model_names` (default: its model argument).

    With `start_engine=True` the app's lifespan runs `async with llm`; pass False for an engine the caller
    already started (and will stop). `api_key`, if set, is required as `Authorization: Bearer <key>` on /v1/*.
    `options` holds the limits and behaviours (body size, concurrency, timeouts, shutdown); the header timeout,
    the shutdown grace period and the exit on engine death need the app run by `vx.serve.server.run`.
    A request's own `chat_template` is refused unless `trust_request_chat_template`; every template renders in
    renderer processes under `chat_template_limits` (vx/serve/template_sandbox.py). `freeze_heap` (for a process
    that only serves, as `vx serve`'s) moves what start-up built out of the garbage collector's full passes.
    """
    names = list(served_model_names or [])
    if not names:
        names = [llm.engine_args.model or _default_model_name()]
    state = ServerState(llm=llm, served_model_names=names, api_key=api_key or None, chat_template=chat_template,
                        metrics=ServerMetrics(), options=options or ServerOptions(),
                        trust_request_chat_template=trust_request_chat_template,
                        templates=TemplateSandbox(chat_template_limits))
    state.metrics.in_flight.set_function(lambda: state.inflight.generating)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.templates.warm()  # a renderer imports its libraries while the engine starts
        try:
            if not start_engine:
                yield
                return
            async with llm, anyio.create_task_group() as watchers:
                watchers.start_soon(state.inflight.watch_loop)
                logger.info("vx serve: the engine is ready; serving %s", ", ".join(names))
                if freeze_heap:
                    # What start-up built lives as long as the server: out of the collector's full passes, which
                    # would otherwise walk it and stall every stream for a large part of a second.
                    gc.collect()
                    gc.freeze()
                try:
                    yield
                finally:
                    watchers.cancel_scope.cancel()
        finally:
            await state.templates.aclose()

    app = FastAPI(title="vx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.vx = state

    def on_error(request: Request, status: int) -> None:
        # Route-level errors (bad JSON, a missing field) never reach the handlers, which count their own.
        if request.url.path in GENERATION_PATHS and getattr(request.state, "vx_counted", False) is False:
            request.state.vx_counted = True
            state.metrics.record_error(request.url.path)

    install_error_handlers(app, on_error)
    app.include_router(_v1_router(state))
    _add_open_routes(app, state)
    app.add_middleware(RequestGuard, state=state)
    app.add_middleware(RequestIdMiddleware)  # outermost: the guard's own errors carry the id too
    document = openapi_document(app, title="vx", version=vx.__version__, api_key_required=state.api_key is not None)
    app.openapi = lambda: document  # type: ignore[method-assign]
    return app


def _default_model_name() -> str:
    from vx.config.model_source import DEFAULT_MODEL

    return DEFAULT_MODEL


def _v1_router(state: ServerState) -> APIRouter:
    # The API key is checked by the request guard, before the body is read. The response models only
    # document the routes (each returns its Response itself).
    router = APIRouter(prefix="/v1")

    @router.get("/models", response_model=ModelList)
    async def list_models() -> Response:
        return _json(ModelList(data=[_card(state, n) for n in state.served_model_names]))

    @router.get("/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str) -> Response:
        return _json(_card(state, state.model_name(model_id)))

    @router.post("/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        request.state.vx_counted = True  # the handler counts its own errors
        return await create_completion(state, body, request.receive)

    @router.post("/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        request.state.vx_counted = True
        return await create_chat_completion(state, body, request.receive)

    @router.post("/embeddings", response_model=EmbeddingResponse)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        request.state.vx_counted = True
        return await create_embeddings(state, body, request.receive)

    @router.post("/responses", response_model=ResponseObject)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        request.state.vx_counted = True
        return await create_response(state, body, request.receive)

    return router


def _add_open_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_model=HealthStatus)
    async def health() -> Response:
        """200 while the engine process lives (status "busy" when it does not answer within a couple of seconds, a
        long step), 503 once it is dead (its process exited or its pipe closed) or not started."""
        try:
            with anyio.move_on_after(_HEALTH_TIMEOUT_S) as waited:
                await state.llm.stats()
        except (EngineDeadError, RuntimeError) as e:
            return APIError(f"The engine is not running: {e}", 503, code="engine_dead").response()
        return JSONResponse(HealthStatus(status="busy" if waited.cancelled_caught else "ok").model_dump())

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus metrics; the engine's gauges are NaN while the engine does not answer."""
        try:
            with anyio.fail_after(_STATS_TIMEOUT_S):
                state.metrics.update_engine(await state.llm.stats())
        except (EngineDeadError, RuntimeError, TimeoutError) as e:
            logger.warning("vx serve: no engine stats for /metrics: %s", e)  # the counters still count
            state.metrics.clear_engine()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _card(state: ServerState, name: str) -> ModelCard:
    # `root` names the model behind the alias: the first served name, never a filesystem path.
    return ModelCard(id=name, root=state.served_model_names[0], max_model_len=state.max_model_len)


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
