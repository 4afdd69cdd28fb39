"""The live page's routes (lesson 13): the page, its files, its event stream, pause and step.

    GET  /                    the page (chat beside the engine's blocks and queues)
    GET  /live/static/NAME    its script and style sheet, shipped in the package
    GET  /live/events         server-sent events: a frame per step seen (``live_feed.py``)
    POST /live/control        {"action": "pause" | "resume" | "step"}: the engine's stepping

The page loads nothing else; its chat goes to the server's own ``/v1/chat/completions``. With an
API key, ``/live/events`` and ``/live/control`` need it like every ``/v1`` route (``auth.py``):
the page and its files hold no data, and the page asks for the key once and sends it with every
call. Without a key, only this machine may pause or step the engine (``may_control``). None of these routes are in the OpenAPI schema: they are not part of the API.
"""
from __future__ import annotations

import html
import importlib.resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from minipaged.entrypoints.live_feed import LiveFeed
from minipaged.entrypoints.openai_protocol import APIError

STATIC = {"live.js": "text/javascript", "live.css": "text/css"}
CONTROLS = ("pause", "resume", "step")


def may_control(client_host: str | None, needs_key: bool) -> bool:
    """Whether a client may pause or step the engine. NOTE: a pause stops every client's
    requests, so on a server without an API key only this machine may (a server listening on
    0.0.0.0 without a key still lets anyone chat, but not stop the others)."""
    return needs_key or client_host in ("127.0.0.1", "::1", "localhost") or \
        (client_host or "").startswith("127.")


def _static(name: str) -> str:
    return (importlib.resources.files("minipaged.entrypoints") / "static" / name).read_text(
        encoding="utf-8")


def add_live_routes(app: FastAPI, feed: LiveFeed, served_model_name: str,
                    needs_key: bool) -> None:
    """Add the page's routes to ``app``.

    Args:
        feed: the engine's frames.
        served_model_name: the ``model`` the page's chat sends.
        needs_key: whether the server has an API key (the page then asks for it).
    """
    page = (_static("live.html")
            .replace("{{MODEL}}", html.escape(served_model_name, quote=True))
            .replace("{{NEEDS_KEY}}", "true" if needs_key else "false"))

    @app.get("/", include_in_schema=False)
    async def live_page():
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/live/static/{name}", include_in_schema=False)
    async def live_static(name: str):
        if name not in STATIC:
            raise APIError(404, f"no file {name!r} here", type="not_found_error")
        return Response(_static(name), media_type=STATIC[name])

    @app.get("/live/events", include_in_schema=False)
    async def live_events(request: Request):
        if not feed.open_stream():
            raise APIError(503, f"{feed.options.max_streams} live pages are open already (the "
                                f"server's --max-live-streams); close one and retry",
                           type="server_busy", code="too_many_streams",
                           headers={"Retry-After": "5"})
        return StreamingResponse(feed.frames(request.is_disconnected),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    @app.post("/live/control", include_in_schema=False)
    async def live_control(request: Request):
        try:
            action = (await request.json()).get("action")
        except (ValueError, AttributeError):
            action = None
        if action not in CONTROLS:
            raise APIError(400, f"action must be one of {', '.join(CONTROLS)}", "action")
        if not may_control(request.client.host if request.client else None, needs_key):
            raise APIError(403, "without --api-key only this machine may pause or step the "
                                "engine (it stops every client's requests)",
                           type="permission_error", code="control_from_afar")
        engine = feed.async_engine
        {"pause": engine.pause, "resume": engine.resume, "step": engine.step_once}[action]()
        return {"action": action}
