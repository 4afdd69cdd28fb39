"""What one HTTP request may ask of the server, checked before it costs anything (lesson 13).

A server that can be reached by strangers must refuse a hostile request cheaply: a 50 MB body, a
prompt of millions of characters, a hundred thousand stop strings. Each limit here is a flag of
``minipaged serve`` and answers with OpenAI's error body:

    body over --max-body-bytes                 413, before the body is read in full
    prompt over --max-prompt-chars             400, before it is tokenized
    more than --max-stop-strings, or one
      longer than --max-stop-chars             400
    n or best_of over --max-n                  400
    logprobs / top_logprobs over --max-logprobs 400
    more waiting than --max-waiting-requests   503 with Retry-After (``AsyncLLMEngine``)

What the engine itself refuses (a prompt past the context, a request the KV pool can never hold)
is checked by ``LLMEngine.validate_request``, not here.
"""
from __future__ import annotations

from dataclasses import dataclass

from starlette.exceptions import HTTPException

from minipaged.entrypoints.openai_protocol import APIError

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits on one request (None: derived from the engine, see ``resolve``).

    Args:
        max_body_bytes: the largest request body.
        max_prompt_chars: the most characters of prompt text (all prompts, or all messages,
            of one request). None: ``max_model_len`` times the tokenizer's longest token, the
            most characters that can still fit in the context.
        max_stop_strings: the most stop strings of one request.
        max_stop_chars: the most characters of one stop string.
        max_n: the largest ``n`` and ``best_of``.
        max_logprobs: the largest ``logprobs`` (completions) and ``top_logprobs`` (chat).
        max_waiting_requests: the most requests waiting for their prompt to run. None: four
            times ``max_num_seqs``.
    """

    max_body_bytes: int = 2 * MiB
    max_prompt_chars: int | None = None
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_n: int = 128  # (OpenAI's own bound on n)
    max_logprobs: int = 20
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def resolve(self, engine) -> ServerLimits:
        """These limits with every None replaced by what the engine implies.

        Args:
            engine: the ``LLMEngine`` served (its tokenizer, max_model_len and max_num_seqs).
        """
        prompt_chars = self.max_prompt_chars
        if prompt_chars is None:
            prompt_chars = engine.max_model_len * longest_token_chars(engine.tokenizer)
        waiting = self.max_waiting_requests
        if waiting is None:
            waiting = 4 * engine.scheduler_config.max_num_seqs
        return ServerLimits(self.max_body_bytes, prompt_chars, self.max_stop_strings,
                            self.max_stop_chars, self.max_n, self.max_logprobs, waiting)

    # -- the checks of one parsed request (all before tokenizing) ------------------------------
    def check_request(self, body, texts: list[str], num_prompts: int) -> None:
        """Raise a 400 ``APIError`` if a resolved limit refuses this request.

        Args:
            body: the parsed ``CompletionRequest`` or ``ChatCompletionRequest``.
            texts: its prompt text (or message contents), not yet tokenized.
            num_prompts: how many engine requests it becomes.
        """
        if num_prompts > self.max_waiting_requests:
            raise APIError(400, f"prompt holds {num_prompts} prompts; this server queues at most "
                                f"{self.max_waiting_requests}", "prompt")
        chars = sum(len(t) for t in texts)
        if chars > self.max_prompt_chars:
            field = "messages" if hasattr(body, "messages") else "prompt"
            raise APIError(400, f"{chars} characters of {field} text; this server takes at most "
                                f"{self.max_prompt_chars} (more cannot fit in the context)",
                           field, code="context_length_exceeded")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.max_stop_strings:
            raise APIError(400, f"stop holds {len(stops)} strings; at most "
                                f"{self.max_stop_strings} are allowed", "stop")
        if any(len(s) > self.max_stop_chars for s in stops):
            raise APIError(400, f"stop strings may be at most {self.max_stop_chars} characters "
                                f"long", "stop")
        for name in ("n", "best_of"):
            value = getattr(body, name)
            if value is not None and value > self.max_n:
                raise APIError(400, f"{name} must be at most {self.max_n}, got {value}", name)
        name, value = (("top_logprobs", body.top_logprobs) if hasattr(body, "top_logprobs")
                       else ("logprobs", body.logprobs))
        if value is not None and not 0 <= value <= self.max_logprobs:
            raise APIError(400, f"{name} must be in [0, {self.max_logprobs}], got {value}", name)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` can stand for (1 without a tokenizer).

    NOTE: measured on the vocabulary's own strings. A byte-level BPE token (GPT-2, LLaMA 3,
    SmolLM2) is written with one character per byte, and a SentencePiece token with one per
    character (``<0x41>`` byte tokens even longer), so no token decodes to more characters than
    its string has: a prompt longer than max_model_len times this needs more tokens than fit."""
    if tokenizer is None:
        return 1  # text prompts are refused anyway: nothing can tokenize them
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


# -- the body size, before the body is read ---------------------------------------------------
class BodyTooLarge(HTTPException):
    """413: raised while the body is read, as soon as it passes the limit.

    NOTE: an HTTPException, so FastAPI passes it through while parsing the body (any other
    exception there becomes a 400 "error parsing the body")."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server takes "
                              f"({limit} bytes); send a smaller one")


class BodySizeLimit:
    """ASGI middleware: refuse a body larger than ``max_bytes`` with 413 without reading it all.

    A declared ``Content-Length`` over the limit is refused before a byte of the body is read;
    a body without one (chunked) is counted as it arrives and refused once it passes the limit.
    Either way at most ``max_bytes`` (plus one network chunk) is ever held in memory.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, scope, receive, send) -> None:
        from fastapi.responses import JSONResponse

        error = APIError(413, BodyTooLarge(self.max_bytes).detail, code="request_too_large")
        # NOTE: "Connection: close": the unread body is never read; the connection cannot
        # carry another request after it.
        response = JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)
