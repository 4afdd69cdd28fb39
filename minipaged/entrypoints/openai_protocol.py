"""The OpenAI API's request bodies, checked field by field, its response bodies and its error
body (lesson 13).

A request is parsed in two steps, and either can refuse it with an HTTP 400 that the official
``openai`` client turns into ``openai.BadRequestError``:

    JSON body --pydantic (types, unknown fields)--> CompletionRequest / ChatCompletionRequest
              --sampling_params (ranges, via SamplingParams' own checks)--> SamplingParams

The server's own limits (``limits.py``) come between the two; what only the engine knows (the
context, the KV pool) is checked after, by ``LLMEngine.validate_request``.

Types are strict (``"0.5"`` is not a number, ``true`` is not an integer) so that a client's
mistake is reported instead of guessed at. Fields vLLM adds to the API (``top_k``,
``ignore_eos``, ``use_beam_search``) are accepted too.

A response is built from the engine's ``RequestOutput``s by ``CompletionFormat`` or
``ChatFormat`` (the same choices whole or as streamed chunks) and ``usage``.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr,
                      ValidationError, WrapValidator)
from pydantic_core import PydanticCustomError

from minipaged.sampling_params import SamplingParams

Number = Annotated[float, Strict()]  # a JSON number (integers too), never a string or a bool


def one_of(forms: str) -> WrapValidator:
    """For a field of several accepted types: one error naming the field and the forms.

    NOTE: left alone, pydantic reports every alternative that failed, each at a location that
    ends with the alternative's type (``prompt.str``, ``messages.0.content.list[TextPart]``);
    a client wants the field itself and what it may hold."""
    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "must be {forms}", {"forms": forms}) from None

    return WrapValidator(validate)


class APIError(Exception):
    """An error with an HTTP status, OpenAI's error body and, if any, HTTP headers."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                        type, code)
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def server_error(message: str) -> APIError:
    """A 500: the engine died, or something no check foresaw went wrong."""
    return APIError(500, message, type="server_error", code="internal_error")


def describe(exc: BaseException) -> str:
    """The message of a 500 for an exception nothing expected."""
    return f"internal error while handling the request: {type(exc).__name__}: {exc}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    n: StrictInt = 1
    best_of: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = -1
    max_tokens: StrictInt | None = None
    stop: Annotated[StrictStr | list[StrictStr] | None,
                    one_of("a string or a list of strings")] = None
    seed: StrictInt | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    use_beam_search: StrictBool = False
    user: StrictStr | None = None  # accepted and ignored, as OpenAI's servers log it
    logit_bias: dict[str, Number] | None = None

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")
        if self.stream and (self.use_beam_search or
                            (self.best_of is not None and self.best_of > self.n)):
            # NOTE: the n best of best_of are known only at the end, so there is nothing to
            # stream before then; OpenAI refuses the same combination.
            raise APIError(400, "stream cannot be used with best_of > n or beam search", "stream")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams from these fields; its ValueError becomes a 400 naming the field."""
        try:
            return SamplingParams(
                n=self.n, best_of=self.best_of, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, temperature=self.temperature,
                top_p=self.top_p, top_k=self.top_k, use_beam_search=self.use_beam_search,
                stop=self.stop, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
                logprobs=logprobs, seed=self.seed)
        except ValueError as e:
            raise APIError(400, str(e), param_of(str(e))) from None


class CompletionRequest(_SamplingFields):
    # a string, a list of strings, a list of token ids, or a list of lists of token ids
    prompt: Annotated[Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]],
                      one_of("a string, a list of strings, a list of token ids (integers) or a "
                             "list of lists of token ids")]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")

    def prompt_list(self) -> list[str | list[int]]:
        """Each prompt on its own: text, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or any(len(x) == 0 for x in p):
            raise APIError(400, "prompt must not be empty", "prompt")
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. tool_calls: ignored, as text-only chat
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[StrictStr | list[TextPart] | None,
                       one_of('a string or a list of text parts ({"type": "text", '
                              '"text": "..."})')] = None
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")

    def conversation(self) -> list[dict]:
        """Messages as the plain dicts a chat template reads (``developer`` acts as system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


def param_of(message: str) -> str | None:
    """The request field an error message is about, if it starts with one (``top_p must ...``)."""
    word = message.split(" ", 1)[0]
    if word in _FIELDS:
        return word
    if message.startswith("prompt"):
        return "prompt"
    return None


def validation_error(errors: list[dict]) -> APIError:
    """An APIError from pydantic's (FastAPI's) list of validation errors: the first one."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    kind = first.get("type", "")
    param = ".".join(loc) or None
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}")
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return APIError(400, f"missing required field: {param}", param)
    if not loc:
        return APIError(400, "the request body must be a JSON object")
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param)


# -- response bodies -----------------------------------------------------------------------------
def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def top_logprobs(logprobs: dict[int, float], chosen: int, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one step, most likely first.

    The sampler's dict holds the top ``k`` and the chosen token: ``k`` entries when the chosen
    token is among the top ``k``, ``k + 1`` when it is not (then the chosen one is the extra)."""
    top = logprobs if len(logprobs) <= k else {t: v for t, v in logprobs.items() if t != chosen}
    return sorted(top.items(), key=lambda kv: -kv[1])[:k]


class CompletionFormat:
    """``/v1/completions`` choices and chunks (OpenAI's legacy format)."""

    object, chunk_object = "text_completion", "text_completion"

    def __init__(self, model: str, tokenizer, n: int, logprobs: int | None) -> None:
        self.model, self.tokenizer, self.n, self.logprobs = model, tokenizer, n, logprobs
        self._text_offset: dict[int, int] = {}  # per choice: characters of its tokens so far

    def first_delta(self, index: int):
        return None

    def _logprobs(self, index: int, ids: list[int], logprobs):
        if self.logprobs is None or logprobs is None:
            return None
        tokens = [token_text(self.tokenizer, t) for t in ids]
        # text_offset counts from the start of the choice's text, across streamed chunks too.
        offsets, offset = [], self._text_offset.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offset[index] = offset
        tops = []
        for lp in logprobs:
            # NOTE: as OpenAI's legacy completions: the top ``logprobs`` tokens plus the sampled
            # one when it is not among them, so up to logprobs + 1 entries -- which is exactly
            # the sampler's dict. Two tokens with the same text keep the likelier logprob.
            top: dict[str, float] = {}
            for t, v in sorted(lp.items(), key=lambda kv: -kv[1]):
                top.setdefault(token_text(self.tokenizer, t), v)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [lp.get(t) for t, lp in zip(ids, logprobs)],
                "top_logprobs": tops, "text_offset": offsets}

    def choice(self, index, text, ids, logprobs, finish_reason) -> dict:
        return {"index": index, "text": text, "logprobs": self._logprobs(index, ids, logprobs),
                "finish_reason": finish_reason}

    delta = choice  # a streamed completion chunk has the same shape, with the new text


class ChatFormat:
    """``/v1/chat/completions`` choices and chunks; ``top_logprobs`` None: no logprobs."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, tokenizer, n: int, top_logprobs: int | None) -> None:
        self.model, self.tokenizer, self.n, self.top_logprobs = model, tokenizer, n, top_logprobs

    def first_delta(self, index: int):
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def _entry(self, token_id: int, logprob: float | None) -> dict:
        text = token_text(self.tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, ids, logprobs):
        if self.top_logprobs is None or logprobs is None:
            return None
        # The chosen token's own logprob is in "logprob"; "top_logprobs" is exactly the top N.
        return {"content": [
            {**self._entry(t, lp.get(t)),
             "top_logprobs": [self._entry(k, v) for k, v in top_logprobs(lp, t,
                                                                         self.top_logprobs)]}
            for t, lp in zip(ids, logprobs)]}

    def choice(self, index, text, ids, logprobs, finish_reason) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(ids, logprobs), "finish_reason": finish_reason}

    def delta(self, index, text, ids, logprobs, finish_reason) -> dict:
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": self._logprobs(ids, logprobs), "finish_reason": finish_reason}


def usage(outputs) -> dict:
    """``usage`` of a response from its RequestOutputs (one per prompt).

    NOTE: completion_tokens counts the tokens of the choices returned, as vLLM does, so a client
    can check it against the response. With best_of > n the engine generated best_of sequences
    and returns the n best; OpenAI bills all of them, but the other best_of - n never reach the
    client, so they are not counted here (``minipaged_generation_tokens_total`` in /metrics
    counts every generated token). Each prompt counts once, whatever n is."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
