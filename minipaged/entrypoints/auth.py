"""API keys: ``minipaged serve --api-key KEY`` (or ``MINIPAGED_API_KEY``) (lesson 13).

With a key, every ``/v1/...`` route, the live page's event stream and controls (and
``/metrics``, unless ``--metrics-public``) answer only
a request that carries ``Authorization: Bearer KEY`` -- what the ``openai`` client sends for
``OpenAI(api_key=KEY)``. Anything else gets 401 and OpenAI's error body before the request is
parsed or its body read. ``/health`` stays open, for load balancers and probes.
"""
from __future__ import annotations

import hashlib
import hmac

from fastapi.responses import JSONResponse

from minipaged.entrypoints.openai_protocol import APIError


def same_key(given: bytes, expected: str) -> bool:
    """Whether the key a client sent equals ours, in a time that does not depend on where they
    differ.

    Args:
        given: the key as sent, in the header's raw bytes.
        expected: the server's key (its UTF-8 bytes are compared).

    NOTE: hashed first, so that neither the position of the first difference nor the length of
    the real key can be learned from how long a wrong guess takes to be refused."""
    return hmac.compare_digest(hashlib.sha256(given).digest(),
                               hashlib.sha256(expected.encode("utf-8", "surrogatepass")).digest())


def needs_key(path: str, metrics_public: bool) -> bool:
    """Whether a request to ``path`` must carry the API key."""
    if path == "/metrics":
        return not metrics_public
    if path in ("/live/events", "/live/control"):  # the live page's data (its files hold none)
        return True
    return path == "/v1" or path.startswith("/v1/")


class APIKeyAuth:
    """ASGI middleware: 401 for a protected route without ``Authorization: Bearer <api_key>``.

    Args:
        app: the ASGI app it guards.
        api_key: the key clients must send.
        metrics_public: leave ``/metrics`` open (for a Prometheus scraper without the key).
    """

    def __init__(self, app, api_key: str, metrics_public: bool = False) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app, self.api_key, self.metrics_public = app, api_key, metrics_public

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"], self.metrics_public):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"bearer" and same_key(given.strip(), self.api_key):
            return await self.app(scope, receive, send)
        if not header:
            message = ("no API key given: send it as 'Authorization: Bearer KEY' "
                       "(the openai client does this for api_key=KEY)")
        else:
            message = "incorrect API key provided"  # (never echoed: it may be someone's secret)
        error = APIError(401, message, code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
