"""An OpenAI-compatible HTTP server in front of the engine: ``minipaged serve`` (lesson 13).

    GET  /v1/models              the one model this server serves
    POST /v1/completions         text (or token ids) in, text out; ``"stream": true`` for SSE
    POST /v1/chat/completions    messages in, formatted by the tokenizer's chat template
    GET  /health                 200 while the engine loop runs, 500 once it has died
    GET  /metrics                Prometheus text: queues, KV blocks, token and preemption counters
    GET  /                       the live page: a chat beside the engine's blocks, step by step
                                 (``live_routes.py``, ``live_feed.py``)

A request passes, in order: the API key (``auth.py``), the body size (``limits.py``), pydantic's
field checks (``openai_protocol.py``), the server's limits, tokenizing and the engine's own
``validate_request`` in a worker thread (``prompts.py``), the waiting queue's bound
(``AsyncLLMEngine``), and then it is answered whole or streamed (``responses.py``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from minipaged.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from minipaged.entrypoints.auth import APIKeyAuth
from minipaged.entrypoints.limits import BodySizeLimit, ServerLimits
from minipaged.entrypoints.live_feed import LiveFeed, LiveOptions
from minipaged.entrypoints.live_routes import add_live_routes
from minipaged.entrypoints.metrics import prometheus_text
from minipaged.entrypoints.openai_protocol import (APIError, ChatCompletionRequest, ChatFormat,
                                                   CompletionFormat, CompletionRequest, describe,
                                                   server_error, validation_error)
from minipaged.entrypoints.prompts import chat_request, completion_requests
from minipaged.entrypoints.responses import respond

logger = logging.getLogger("minipaged.entrypoints.api_server")
_ERROR_KINDS = {404: ("not_found_error", None), 413: ("invalid_request_error", "request_too_large")}


@dataclass(frozen=True)
class ServerOptions:
    """What makes a server safe to expose.

    Args:
        api_key: the key every ``/v1`` route requires as ``Authorization: Bearer KEY``; None:
            no key (anyone who reaches the port may use the engine).
        metrics_public: leave ``/metrics`` open when there is a key.
        limits: what one request may ask (``ServerLimits``).
        live: the live page's settings (``LiveOptions``); None: no page.
    """

    api_key: str | None = None
    metrics_public: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)
    live: LiveOptions | None = field(default_factory=LiveOptions)


def build_app(async_engine: AsyncLLMEngine, served_model_name: str,
              options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and stops it at shutdown.

    Args:
        async_engine: the engine loop to serve; its ``max_waiting_requests`` is set from the
            limits (an explicit limit wins, then the engine's own, then 4 x max_num_seqs).
        served_model_name: the name clients pass as ``model``.
        options: the API key and limits (the defaults when None).
    """
    options = options or ServerOptions()
    engine = async_engine.engine
    waiting = options.limits.max_waiting_requests or async_engine.max_waiting_requests
    limits = replace(options.limits, max_waiting_requests=waiting).resolve(engine)
    async_engine.max_waiting_requests = limits.max_waiting_requests

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            # NOTE: closed here: after a SIGTERM uvicorn ends the process by that signal, and no
            # atexit handler runs
            if engine.trace is not None:
                engine.trace.close()

    app = FastAPI(title="minipaged", lifespan=lifespan)
    app.state.limits = limits
    # (the last added runs first: the key, then the body size, then everything else)
    app.add_middleware(_UnexpectedErrorsAsJSON)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if options.api_key is not None:
        app.add_middleware(APIKeyAuth, api_key=options.api_key,
                           metrics_public=options.metrics_public)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, exc: RequestValidationError):
        error = validation_error(list(exc.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind, code = _ERROR_KINDS.get(exc.status_code, ("invalid_request_error", None))
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind,
                                     code=code).body(), status_code=exc.status_code)

    if options.live is not None:
        app.state.live_feed = LiveFeed(async_engine, options.live)
        add_live_routes(app, app.state.live_feed, served_model_name, options.api_key is not None)

    @app.get("/health")
    async def health():
        try:
            async_engine.check_health()
        except EngineDeadError as e:
            return JSONResponse(server_error(str(e)).body(), status_code=500)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(async_engine),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created,
            "owned_by": "minipaged", "max_model_len": engine.max_model_len}]}

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{served_model_name!r}", "model", code="model_not_found")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.check_unsupported()
        prompts = body.prompt_list()
        limits.check_request(body, [p for p in prompts if isinstance(p, str)], len(prompts))

        def make_params(max_tokens: int):
            return body.sampling_params(max_tokens, body.logprobs)

        make_params(1)  # every field checked before any work
        requests = await asyncio.to_thread(completion_requests, engine, prompts, make_params,
                                           body.max_tokens)
        return await respond(async_engine, body, requests, request, "cmpl", CompletionFormat(
            served_model_name, engine.tokenizer, body.n, body.logprobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.check_unsupported()
        conversation = body.conversation()
        limits.check_request(body, [m["content"] for m in conversation], 1)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None

        def make_params(max_tokens: int):
            return body.sampling_params(max_tokens, logprobs)

        make_params(1)
        requested = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        prompt = await asyncio.to_thread(chat_request, engine, conversation, make_params,
                                         requested)
        return await respond(async_engine, body, [prompt], request, "chatcmpl", ChatFormat(
            served_model_name, engine.tokenizer, body.n, logprobs))

    return app


class _UnexpectedErrorsAsJSON:
    """ASGI middleware: an exception no handler expected (a bug, say in a tokenizer) answers its
    request with OpenAI's error body and status 500; the traceback goes to the log.

    NOTE: not an exception handler for ``Exception``: Starlette re-raises after calling that
    one, and uvicorn then closes the connection under a client that keeps it alive."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:  # too late for a status: the server closes the connection
                raise
            logger.exception("while handling %s %s", scope.get("method"), scope.get("path"))
            response = JSONResponse(server_error(describe(exc)).body(), status_code=500)
            await response(scope, receive, send)


# -- running it ----------------------------------------------------------------------------------
class BackgroundServer:
    """uvicorn serving ``app`` from a thread, for notebooks and tests: ``with BackgroundServer(app)``.

    ``url`` is where it listens (port 0 picks a free port); ``stop()`` shuts it down, then calls
    ``on_stop`` (once)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 on_stop=None) -> None:
        import uvicorn

        self.app = app
        self._on_stop = on_stop
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                     log_level="warning"))
        _end_live_streams_at_shutdown(app, self._server)
        self._thread = threading.Thread(target=self._server.run, name="minipaged-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        sock = self._server.servers[0].sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        on_stop, self._on_stop = self._on_stop, None
        if on_stop is not None:
            on_stop()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(async_engine: AsyncLLMEngine, served_model_name: str, host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info",
          options: ServerOptions | None = None) -> None:
    """Serve until interrupted (what ``minipaged serve`` runs).

    Args:
        host: the address to listen on; anything but 127.0.0.1 lets other machines in.
        options: the API key and the limits (the defaults when None).
    """
    import uvicorn

    app = build_app(async_engine, served_model_name, options)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    _end_live_streams_at_shutdown(app, server)
    server.run()


def _end_live_streams_at_shutdown(app: FastAPI, server) -> None:
    """The live page's streams end as soon as uvicorn starts to shut down.

    NOTE: uvicorn waits for every open response before it shuts down the app, and an event
    stream never ends by itself: an open page would hold Ctrl-C forever."""
    feed = getattr(app.state, "live_feed", None)
    if feed is not None:
        feed.stopping = lambda: server.should_exit
