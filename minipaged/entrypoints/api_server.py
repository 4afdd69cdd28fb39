"""An OpenAI-compatible HTTP server in front of the engine: ``minipaged serve`` (lesson 08).

    GET  /v1/models              the one model this server serves
    POST /v1/completions         text (or token ids) in, text out; ``"stream": true`` for SSE
    POST /v1/chat/completions    messages in, formatted by the tokenizer's chat template
    GET  /health                 200 while the engine loop runs, 500 once it has died
    GET  /metrics                Prometheus text: queues, KV blocks, token and preemption counters

Every request becomes one engine request per prompt, queued through ``AsyncLLMEngine``; the
handler then waits on its own asyncio.Queue while the engine thread steps. A streamed response
sends one ``data: {json}`` event per piece of new text and ends with ``data: [DONE]``. A client
that disconnects -- while waiting, mid-stream, or before a non-streamed answer -- has its requests
aborted, so their KV blocks return to the pool at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from minipaged.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, PromptRequest, TextStreamer
from minipaged.entrypoints.openai_protocol import (APIError, ChatCompletionRequest, ChatFormat,
                                       CompletionFormat, CompletionRequest, param_of, usage,
                                       validation_error)
from minipaged.outputs import RequestOutput
from minipaged.sampling_params import SamplingParams

logger = logging.getLogger("minipaged.entrypoints.api_server")


def build_app(async_engine: AsyncLLMEngine, served_model_name: str) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and stops it at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="minipaged", lifespan=lifespan)
    app.add_middleware(_UnexpectedErrorsAsJSON)
    engine = async_engine.engine
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, exc: RequestValidationError):
        error = validation_error(list(exc.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(),
                            status_code=exc.status_code)

    @app.get("/health")
    async def health():
        try:
            async_engine.check_health()
        except EngineDeadError as e:
            return JSONResponse(_server_error(str(e)).body(), status_code=500)
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
        probe = body.sampling_params(1, body.logprobs)  # every field checked before any work
        prompts = []
        for p in body.prompt_list():
            ids = _encode(engine, p) if isinstance(p, str) else p
            max_tokens = _max_tokens(engine, body.max_tokens, 16, len(ids), probe, "prompt")
            prompts.append(PromptRequest(p if isinstance(p, str) else None,
                                         body.sampling_params(max_tokens, body.logprobs), ids))
        return await _respond(async_engine, body, prompts, request, "cmpl", CompletionFormat(
            served_model_name, engine.tokenizer, body.n, body.logprobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.check_unsupported()
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        probe = body.sampling_params(1, logprobs)
        ids = _chat_prompt_ids(engine.tokenizer, body.conversation())
        requested = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        # as OpenAI: without max_tokens, as much as the context leaves (and the pool holds)
        max_tokens = _max_tokens(engine, requested, None, len(ids), probe, "messages")
        params = body.sampling_params(max_tokens, logprobs)
        return await _respond(async_engine, body, [PromptRequest(None, params, ids)], request,
                              "chatcmpl", ChatFormat(served_model_name, engine.tokenizer,
                                                     body.n, logprobs))

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
            response = JSONResponse(_server_error(_describe(exc)).body(), status_code=500)
            await response(scope, receive, send)


# -- one request, start to end -----------------------------------------------------------------
async def _respond(async_engine: AsyncLLMEngine, body, prompts: list[PromptRequest],
                   request: Request, prefix: str, fmt):
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
    outputs: asyncio.Queue = asyncio.Queue()
    try:
        # NOTE: queued before the response starts, so a bad request is still a plain 400.
        await async_engine.add_requests(request_ids, prompts, outputs)
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e))) from None
    except EngineDeadError as e:
        raise _server_error(str(e)) from None
    stream = async_engine.stream_outputs(request_ids, outputs)

    def abort_all() -> None:  # harmless for requests that finished
        for request_id in request_ids:
            async_engine.abort(request_id)

    index_base = {rid: i * body.n for i, rid in enumerate(request_ids)}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _sse_events(stream, fmt, response_id, index_base, prompts, include_usage)
        return StreamingResponse(_abort_on_disconnect(events, request, abort_all),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def collect() -> dict[str, RequestOutput]:
        final = {}
        async for request_id, output in stream:
            final[request_id] = output
        return final

    try:
        final = await _until_disconnect(collect(), request)
    except EngineDeadError as e:
        raise _server_error(str(e)) from None
    finally:
        abort_all()
    if final is None:  # the client is gone; nobody reads this answer
        return JSONResponse({}, status_code=499)
    results = [final[rid] for rid in request_ids]
    for output in results:
        if output.error:
            raise _server_error(output.error)
    choices = [fmt.choice(index_base[o.request_id] + c.index, c.text, c.token_ids, c.logprobs,
                          c.finish_reason)
               for o in results for c in o.outputs]
    return {"id": response_id, "object": fmt.object, "created": int(time.time()),
            "model": fmt.model, "choices": choices, "usage": usage(results)}


async def _sse_events(stream, fmt, response_id: str, index_base: dict[str, int],
                      prompts: list[PromptRequest], include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    streamers: dict[int, TextStreamer] = {}
    final: dict[str, RequestOutput] = {}

    def event(choices, usage_body=None) -> str:
        chunk = {"id": response_id, "object": fmt.chunk_object, "created": created,
                 "model": fmt.model, "choices": choices}
        if include_usage:
            chunk["usage"] = usage_body
        return f"data: {json.dumps(chunk)}\n\n"

    try:
        for index in sorted(index_base.values()):  # the chat format's opening role chunks
            for i in range(index, index + fmt.n):
                if (first := fmt.first_delta(i)) is not None:
                    yield event([first])
        async for request_id, output in stream:
            if output.finished:
                final[request_id] = output
                if output.error:
                    raise _server_error(output.error)
            choices = []
            for c in output.outputs:
                index = index_base[request_id] + c.index
                streamer = streamers.setdefault(
                    index, TextStreamer(prompts[0].sampling_params.stop_strings))
                delta, ids, logprobs = streamer.update(c)
                # (new tokens without new text still carry their logprobs to the client)
                if delta or (ids and logprobs) or c.finish_reason is not None:
                    choices.append(fmt.delta(index, delta, ids, logprobs, c.finish_reason))
            if choices:
                yield event(choices)
        if include_usage:
            yield event([], usage(list(final.values())))
    except Exception as e:  # the response has started: the error goes in an event
        error = e if isinstance(e, APIError) else _server_error(
            str(e) if isinstance(e, EngineDeadError) else _describe(e))
        yield f"data: {json.dumps(error.body())}\n\n"
    yield "data: [DONE]\n\n"


# -- disconnects -------------------------------------------------------------------------------
async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(coro, request: Request):
    """Await ``coro``; return None instead if the client leaves first (``coro`` is cancelled)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # its requests are aborted as the cancellation unwinds it
    if not work.done() or work.cancelled():
        return None
    return work.result()


async def _abort_on_disconnect(events: AsyncIterator[str], request: Request, abort_all):
    """Pass events through; stop as soon as the client leaves, and then abort the requests.

    Starlette notices a disconnect only when a write fails or, on some servers, by listening
    itself; watching here too covers a client that leaves while its request still waits.
    NOTE: the clean-up calls no ``await``: it may run while the task is being cancelled."""
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    nxt = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(events))
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        abort_all()
        gone.cancel()
        if nxt is not None:
            nxt.cancel()


# -- prompts ---------------------------------------------------------------------------------------
def _encode(engine, text: str) -> list[int]:
    try:
        return engine.encode(text)
    except ValueError as e:  # e.g. a model directory without a tokenizer
        raise APIError(400, str(e), "prompt") from None


def _max_tokens(engine, requested: int | None, default: int | None, prompt_len: int,
                params: SamplingParams, prompt_field: str) -> int:
    """The max_tokens of one prompt: the client's, if the context holds it; else a default.

    Args:
        requested: the client's max_tokens, or None.
        default: the endpoint's default (16 for completions), or None for "what the context
            leaves" (chat, as OpenAI).
        params: the request's SamplingParams (for best_of; their max_tokens is ignored).
        prompt_field: "prompt" or "messages", for the error.
    """
    context = engine.max_model_len
    if requested is not None:
        if requested >= 1 and prompt_len + requested > context:  # (< 1: SamplingParams says so)
            raise APIError(
                400, f"This model's maximum context length is {context} tokens. However, you "
                     f"requested {prompt_len + requested} tokens ({prompt_len} in the "
                     f"{prompt_field}, {requested} in the completion). Please reduce the length "
                     f"of the {prompt_field} or completion.", prompt_field,
                code="context_length_exceeded")
        return requested
    limit = context - prompt_len if default is None else min(default, context - prompt_len)
    if limit < 1:
        return 1  # the prompt alone fills the context: validate_request says so
    # NOTE: the default is capped to what the KV pool can hold for best_of sequences of this
    # prompt. "What the context leaves" may be far more than that: the embedded SmolLM2 on the
    # CPU leaves 8,162 tokens after a short chat prompt, and n = 3 such sequences need 1,534
    # blocks where the pool has 1,442 usable; validate_request would then refuse a request
    # the client never gave a length for. A max_tokens the client gives is never capped.
    bm = engine.block_manager
    room = bm.num_total_gpu_blocks - bm.watermark_blocks

    def fits(max_tokens: int) -> bool:
        return engine.max_blocks_needed(prompt_len, replace(params, max_tokens=max_tokens)) <= room

    if fits(limit):
        return limit
    if not fits(1):
        return 1  # nothing fits: validate_request says why
    low, high = 1, limit  # fits(low), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _chat_prompt_ids(tokenizer, conversation: list[dict]) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       "messages")
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:  # the template itself refuses (e.g. roles in an order it forbids)
        raise APIError(400, f"the chat template refused these messages: {e}", "messages")
    return tokenizer.encode(text, add_special_tokens=False)


def _server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def _describe(exc: BaseException) -> str:
    return f"internal error while handling the request: {type(exc).__name__}: {exc}"


# -- /metrics -----------------------------------------------------------------------------------
_GAUGES = [
    ("num_requests_running", "Requests in the running queue."),
    ("num_requests_waiting", "Requests waiting for their prompt to be scheduled."),
    ("num_requests_swapped", "Requests whose KV blocks were swapped out to the CPU pool."),
    ("gpu_blocks_used", "KV cache blocks in use in the GPU pool."),
    ("gpu_blocks_total", "KV cache blocks in the GPU pool."),
    ("cpu_blocks_used", "KV cache blocks in use in the CPU swap pool."),
    ("cpu_blocks_total", "KV cache blocks in the CPU swap pool."),
]
_COUNTERS = [
    ("prompt_tokens", "Prompt tokens computed (again after a preemption by recompute)."),
    ("generation_tokens", "Tokens generated (sampled), every sequence of best_of and every "
                          "beam counted."),
    ("num_steps", "Engine steps run."),
]


def prometheus_text(async_engine: AsyncLLMEngine) -> str:
    m = async_engine.metrics
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP minipaged_{name} {help_text}", f"# TYPE minipaged_{name} {kind}"])
        lines.extend(f"minipaged_{name}{labels} {value}" for labels, value in samples)

    for key, help_text in _GAUGES:
        metric(key, "gauge", help_text, [("", m[key])])
    for key, help_text in _COUNTERS:
        metric(f"{key}_total", "counter", help_text, [("", m[key])])
    metric("preemptions_total", "counter", "Requests preempted to free KV blocks.",
           [('{mode="recompute"}', m["preemptions_recompute"]),
            ('{mode="swap"}', m["preemptions_swap"])])
    metric("requests_finished_total", "counter", "Requests finished, by finish reason.",
           [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(m["requests_finished"].items())])
    metric("engine_healthy", "gauge", "1 while the engine loop runs, 0 once it has died.",
           [("", int(async_engine.error is None and async_engine.is_running))])
    return "\n".join(lines) + "\n"


# -- running it ----------------------------------------------------------------------------------
class BackgroundServer:
    """uvicorn serving ``app`` from a thread, for notebooks and tests: ``with BackgroundServer(app)``.

    ``url`` is where it listens (port 0 picks a free port); ``stop()`` shuts it down."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                     log_level="warning"))
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

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(async_engine: AsyncLLMEngine, served_model_name: str, host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info") -> None:
    """Serve until interrupted (what ``minipaged serve`` runs)."""
    import uvicorn

    uvicorn.run(build_app(async_engine, served_model_name), host=host, port=port,
                log_level=log_level)
