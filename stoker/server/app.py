"""The FastAPI application: lifespan (load, warm up, start and drain the engine), error
handlers that keep every failure in the OpenAI error shape, and the gatekeeping middleware.

The model loads in a worker thread after the server starts listening, so the liveness
probe answers at once and readiness flips to 200 only once the model is loaded and has
generated its first tokens (NIM's live/ready split).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from stoker.engine.async_engine import AsyncEngine, EngineInfo
from stoker.server import openapi
from stoker.server.errors import ApiError, describe_validation_errors, error_body
from stoker.server.http.anthropic_errors import AnthropicErrors
from stoker.server.http.limits import install_redaction
from stoker.server.observe.metrics import EngineLogLine
from stoker.server.http.middleware import Gatekeeper
from stoker.server.pooling.asgi import PoolingEndpoints
from stoker.server.pooling.models import load_pooling
from stoker.server.routes import router
from stoker.server.generate.serving import ClientDisconnected
from stoker.server.state import ServerSettings, ServerState
from stoker.server.generate.tokenization import ServerTokenizer

logger = logging.getLogger("stoker.server")

EngineFactory = Callable[[], Any]  # builds the generative engine (an LLMEngine), on the engine thread


def _wall_model(info: EngineInfo, profile: str | None) -> Any:
    """The wall verdict's cost model; a failure to build it never stops the server (logged)."""
    from stoker.engine.wall_model import build_wall_model

    try:
        wall = build_wall_model(info, profile)
    except Exception:  # noqa: BLE001 - a missing table entry or bad profile must not fail start-up
        logger.exception("the wall verdict is off: its cost model could not be built")
        return None
    if wall is not None:
        logger.info("the wall: judging every step as %s", wall.describe())
    return wall


def create_app(
    settings: ServerSettings,
    engine_factory: EngineFactory | None,
    on_fatal: Callable[[BaseException], None] | None = None,
    drain_timeout_s: float | None = 30.0,
    pooling: Any = None,
) -> FastAPI:
    """`engine_factory` builds the generative engine (None: the server holds pooling models only);
    `pooling` (server/pooling/models.py: PoolingModels) the embedding / reranker models, if any."""
    state = ServerState(settings)
    state.pooling, state.serves_generation = pooling, engine_factory is not None

    engines: list[AsyncEngine] = []  # the engine once built, for its shutdown (workers) whatever happens next

    async def load() -> None:
        try:
            # Loading, warm-up and every step run on the engine thread (see AsyncEngine's docstring).
            engine = await AsyncEngine.build(engine_factory, observer=state.metrics,
                                             max_waiting_requests=settings.max_waiting_requests)
            engines.append(engine)
            for name, path in settings.lora_modules:  # a bad adapter stops start-up, naming it
                await engine.load_lora(name, path)
                logger.info("LoRA adapter %r loaded from %s", name, path)
            from stoker.engine.tokenizer import load_tokenizer

            info = engine.info
            state.tokenizer = await asyncio.to_thread(load_tokenizer, settings.model_path)
            worker_tokenizer = await asyncio.to_thread(load_tokenizer, settings.model_path)
            # Requests are checked on the tokenizer thread, with its tokenizer (bad_words, prompts).
            state.tokenization = ServerTokenizer(worker_tokenizer, info.max_model_len,
                                                 engine.input_processor(worker_tokenizer))
            if settings.warmup:
                await engine.warm_up()
            state.max_model_len = info.max_model_len
            state.max_num_seqs = info.max_num_seqs
            state.vocab_size = info.vocab_size
            state.metrics.engine_loaded(info.max_model_len)
            state.metrics.wall.set_model(_wall_model(info, settings.roofline_profile))
            engine.start()
            state.engine = engine
            state.ready = True
            logger.info("ready: serving %s as %s (max_model_len %d)", settings.model_path,
                        ", ".join(settings.served_model_names), state.max_model_len)
        except Exception as exc:
            logger.exception("loading the model failed")
            state.load_error = exc
            if on_fatal is not None:
                on_fatal(exc)

    async def log_engine() -> None:
        line = EngineLogLine(state.metrics.wall.summary)
        while True:
            await asyncio.sleep(settings.log_interval_s)
            if state.engine is not None:
                text = line.line(state.engine)
                if text:
                    logger.info(text)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(load()) if engine_factory is not None else None, asyncio.create_task(log_engine()),
                 asyncio.create_task(load_pooling(state, on_fatal)) if pooling is not None else None]
        tasks = [t for t in tasks if t is not None]
        try:
            yield
        finally:
            # uvicorn has stopped listening and waited for open requests; drain what is left.
            state.ready = False
            for t in tasks:
                t.cancel()
            for engine in engines:  # tensor-parallel workers stop here too, also when loading failed
                await engine.shutdown(drain_timeout_s)
                logger.info("engine stopped")
            if state.tokenization is not None:
                state.tokenization.close()
            if state.pooling is not None:
                await state.pooling.shutdown()

    # The routes go to the app's own router, not through include_router: FastAPI 0.165 resolves
    # an included router's routes again on every request (_IncludedRouter); the event loop's CPU
    # per embeddings request fell from 308-322 to 271 us without it (docs/benchmarks.md, "Event-loop CPU per request").
    app = FastAPI(title="Stoker OpenAI-compatible server", version="0.1.0", lifespan=lifespan, routes=router.routes)
    app.state.stoker = state
    openapi.install(app)  # 400 in OpenAI's shape, not FastAPI's 422; each route's real responses

    def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
        state.metrics.reject(status)
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    # Inner to outer: the pooling endpoints before FastAPI's routing (pooling/asgi.py), behind
    # Gatekeeper's key and body limits like every route.
    app.add_middleware(PoolingEndpoints, state=state, error_response=_error)
    app.add_middleware(Gatekeeper, api_key=settings.api_key, max_body_bytes=settings.max_request_body_bytes,
                       on_reject=state.metrics.reject, body_timeout_s=settings.body_read_timeout_s)
    app.add_middleware(AnthropicErrors)  # outermost: /v1/messages errors in Anthropic's shape, Gatekeeper's too
    install_redaction()  # no key or token from a query string in the access log

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients and vLLM expect 400.
        message, param = describe_validation_errors(list(exc.errors()))
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    # Anything else is answered by Gatekeeper (http/middleware.py): a 500 in the OpenAI shape that
    # closes the connection cleanly.

    return app
