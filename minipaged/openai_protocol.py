"""The OpenAI API's request bodies, checked field by field, and its error body (lesson 08).

A request is parsed in two steps, and either can refuse it with an HTTP 400 that the official
``openai`` client turns into ``openai.BadRequestError``:

    JSON body --pydantic (types, unknown fields)--> CompletionRequest / ChatCompletionRequest
              --to_sampling_params (ranges, via SamplingParams' own checks)--> SamplingParams

Types are strict (``"0.5"`` is not a number, ``true`` is not an integer) so that a client's
mistake is reported instead of guessed at. Fields vLLM adds to the API (``top_k``,
``ignore_eos``, ``use_beam_search``) are accepted too.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr

from minipaged.sampling_params import SamplingParams

Number = Annotated[float, Strict()]  # a JSON number (integers too), never a string or a bool
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                        type, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


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
    stop: StrictStr | list[StrictStr] | None = None
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
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", "echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                           "logprobs")

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
    content: StrictStr | list[TextPart] | None = None
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
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                    f"{self.top_logprobs}", "top_logprobs")

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
