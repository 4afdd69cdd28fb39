"""One request from start to end: queued in the engine, answered whole or streamed as
server-sent events, and aborted when its client goes away (lesson 13).

A handler waits on its own asyncio.Queue while the engine thread steps. A streamed response
sends one ``data: {json}`` event per piece of new text and ends with ``data: [DONE]``. A client
that disconnects -- while waiting, mid-stream, or before a non-streamed answer -- has its requests
aborted, so their KV blocks return to the pool at the next step (and a waiting request frees its
place in the queue at once).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from minipaged.engine.async_llm_engine import (AsyncLLMEngine, EngineDeadError, PromptRequest,
                                               QueueFullError, TextStreamer)
from minipaged.entrypoints.openai_protocol import (APIError, describe, param_of, server_error,
                                                   usage)
from minipaged.outputs import RequestOutput

RETRY_AFTER_SECONDS = 1


# -- one request, start to end -----------------------------------------------------------------
async def respond(async_engine: AsyncLLMEngine, body, prompts: list[PromptRequest],
                  request: Request, prefix: str, fmt):
    """Queue ``prompts`` and answer: a JSON body, or an SSE stream if ``body.stream``.

    Args:
        body: the parsed request (for n, stream and stream_options).
        prompts: its checked engine requests, all queued or none.
        prefix: "cmpl" or "chatcmpl", the start of the response id.
        fmt: the ``CompletionFormat`` or ``ChatFormat`` that shapes the choices.
    """
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
    outputs: asyncio.Queue = asyncio.Queue()
    try:
        # NOTE: queued before the response starts, so a bad request is still a plain 400.
        await async_engine.add_requests(request_ids, prompts, outputs)
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e))) from None
    except QueueFullError as e:
        # NOTE: 503 with Retry-After, which the openai client honours: it retries by itself.
        raise APIError(503, str(e), type="server_error", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineDeadError as e:
        raise server_error(str(e)) from None
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
        raise server_error(str(e)) from None
    finally:
        abort_all()
    if final is None:  # the client is gone; nobody reads this answer
        return JSONResponse({}, status_code=499)
    results = [final[rid] for rid in request_ids]
    for output in results:
        if output.error:
            raise server_error(output.error)
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
                    raise server_error(output.error)
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
        error = e if isinstance(e, APIError) else server_error(
            str(e) if isinstance(e, EngineDeadError) else describe(e))
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
