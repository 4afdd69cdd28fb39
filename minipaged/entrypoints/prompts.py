"""From an HTTP request's prompts to engine requests: tokenized, given a max_tokens, and checked
by the engine itself (lesson 13).

    text --tokenizer (in a worker thread)--> token ids
         --max_tokens: the client's, or a default that the context and the KV pool allow
         --LLMEngine.validate_request--> PromptRequest, or a 400 naming the field

NOTE: everything here runs in a worker thread (``asyncio.to_thread``), never on the event loop:
tokenizing a long prompt or rendering a long chat takes milliseconds to seconds, and on the event
loop every other client (``/health`` included) would wait for it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from minipaged.engine.async_llm_engine import PromptRequest
from minipaged.entrypoints.openai_protocol import APIError, param_of
from minipaged.sampling_params import SamplingParams


def completion_requests(engine, prompts: list, make_params: Callable[[int], SamplingParams],
                        max_tokens: int | None) -> list[PromptRequest]:
    """One checked ``PromptRequest`` per prompt of ``/v1/completions``.

    Args:
        engine: the ``LLMEngine`` (its tokenizer, context and checks).
        prompts: text or lists of token ids.
        make_params: the request's SamplingParams for a given max_tokens.
        max_tokens: the client's, or None for the endpoint's default (16, as OpenAI).
    """
    requests = []
    for p in prompts:
        ids = encode(engine, p) if isinstance(p, str) else p
        requests.append(checked_request(engine, p if isinstance(p, str) else None, ids,
                                        make_params, max_tokens, 16, "prompt"))
    return requests


def chat_request(engine, conversation: list[dict], make_params: Callable[[int], SamplingParams],
                 max_tokens: int | None) -> PromptRequest:
    """The checked ``PromptRequest`` of ``/v1/chat/completions`` (arguments as above).

    Without max_tokens the default is, as OpenAI's, as much as the context leaves."""
    ids = chat_prompt_ids(engine.tokenizer, conversation)
    return checked_request(engine, None, ids, make_params, max_tokens, None, "messages")


def checked_request(engine, prompt: str | None, ids: list[int],
                    make_params: Callable[[int], SamplingParams], requested: int | None,
                    default: int | None, prompt_field: str) -> PromptRequest:
    """The request with its max_tokens, once ``LLMEngine.validate_request`` accepts it."""
    params = make_params(max_tokens_for(engine, requested, default, ids, make_params(1),
                                        prompt_field))
    try:
        engine.validate_request(ids, params)
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e))) from None
    return PromptRequest(prompt, params, ids)


def encode(engine, text: str) -> list[int]:
    try:
        return engine.encode(text)
    except ValueError as e:  # e.g. a model directory without a tokenizer
        raise APIError(400, str(e), "prompt") from None


def chat_prompt_ids(tokenizer, conversation: list[dict]) -> list[int]:
    """The token ids of a conversation, formatted by the tokenizer's chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       "messages")
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:  # the template itself refuses (e.g. roles in an order it forbids)
        raise APIError(400, f"the chat template refused these messages: {e}", "messages")
    return tokenizer.encode(text, add_special_tokens=False)


def max_tokens_for(engine, requested: int | None, default: int | None, ids: list[int],
                   params: SamplingParams, prompt_field: str) -> int:
    """The max_tokens of one prompt: the client's, if the context holds it; else a default.

    Args:
        engine: the ``LLMEngine``; its ``validate_request`` decides what the KV pool holds.
        requested: the client's max_tokens, or None.
        default: the endpoint's default (16 for completions), or None for "what the context
            leaves" (chat, as OpenAI).
        ids: the prompt's token ids.
        params: the request's SamplingParams (for best_of; their max_tokens is ignored).
        prompt_field: "prompt" or "messages", for the error.
    """
    context, prompt_len = engine.max_model_len, len(ids)
    if requested is not None:
        # NOTE: the OpenAI API's rule, not the engine's: offline, generation simply stops at the
        # context; a server client is told instead, in OpenAI's words and error code.
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
    # blocks where the pool has 1,442 usable. The engine's own check is the judge, so the rule
    # lives in one place; a max_tokens the client gives is never capped.
    def accepted(max_tokens: int) -> bool:
        try:
            engine.validate_request(ids, replace(params, max_tokens=max_tokens))
        except ValueError:
            return False
        return True

    if accepted(limit):
        return limit
    if not accepted(1):
        return 1  # refused whatever max_tokens is: validate_request says why
    low, high = 1, limit  # accepted(low), not accepted(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if accepted(middle) else (low, middle)
    return low
