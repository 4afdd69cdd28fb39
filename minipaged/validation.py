"""What users pass in, checked before it reaches the engine (lessons 08 and 13).

Two parts, one rule: bad input never hangs the engine or reaches the middle of a step.

- Parsers (``as_token_ids``, ``as_int``, ``as_number``, ``shown``) turn numpy and torch scalars
  into Python numbers and say None (or raise a ValueError that names the value) when the input is
  not of the kind asked for. Engine settings (``config.py``) and sampling values
  (``SamplingParams.verify``) are checked with them.
- Request checks (``RequestLimits``, ``validate_request``, ``max_blocks_needed``, ...): a request
  that could never run (too long for the model, too large for the KV pool, a stop string without
  a tokenizer, ...) is refused with a ValueError that says what to change, so that an accepted
  request always finishes. ``LLMEngine.add_request`` and ``LLMEngine.validate_request`` (which
  the server and ``LLM.generate`` call) use them.

NOTE: this module imports nothing of the package: ``config.py`` and ``sampling_params.py`` import
its parsers, so a ``SamplingParams`` reaches the request checks as an argument only.
"""
from __future__ import annotations

import math
import numbers
import operator
import time
from dataclasses import dataclass


def as_token_ids(token_ids) -> list[int]:
    """A list of Python ints from a list, tuple, 1-D numpy array or 1-D torch tensor of ints."""
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"prompt_token_ids must be a sequence of integers, got {token_ids!r}")
    if hasattr(token_ids, "dtype") and hasattr(token_ids, "tolist"):  # numpy or torch
        kind = str(token_ids.dtype)
        if "int" not in kind or "bool" in kind:
            raise ValueError(f"prompt_token_ids must hold integers, got an array of {kind}")
        if token_ids.ndim != 1:
            raise ValueError(f"prompt_token_ids of one prompt must be 1-D, got shape "
                             f"{tuple(token_ids.shape)}")
        return [int(t) for t in token_ids.tolist()]
    try:
        ids = list(token_ids)
    except TypeError:
        raise ValueError(f"prompt_token_ids must be a sequence of integers, got "
                         f"{type(token_ids).__name__}") from None
    # numpy / torch integer scalars become Python ints; anything else is left for validation.
    return [int(t) if type(t).__name__ in _INT_SCALARS else t for t in ids]


_INT_SCALARS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def as_int(value):
    """``value`` as a Python int if it is an integer (numpy integer scalars too), else None.

    Booleans are not integers here: ``n=True`` is a mistake, not 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None  # (numpy's bool_ is not Integral either)
    return operator.index(value)


def as_number(value):
    """``value`` as a Python int or float if it is a finite real number, else None.

    numpy scalars become Python numbers; an int too large for a float (``10**400``) is not
    finite here, so it gets a ValueError instead of an OverflowError in the middle of a check.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if isinstance(value, numbers.Integral):
        value = operator.index(value)
    else:
        value = float(value)
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return None
    return value if finite else None


def env_choice(variable: str, allowed) -> str | None:
    """The environment variable ``variable``'s value, one of ``allowed``, or None when unset
    (a ValueError names the variable and what it may be)."""
    import os

    value = os.environ.get(variable, "")
    if value and value not in allowed:
        raise ValueError(f"{variable} must be one of {sorted(allowed)} (or unset), "
                         f"got {value!r}")
    return value or None


def shown(value) -> str:
    """``repr(value)`` for an error message, with a huge integer shortened to its magnitude."""
    text = repr(value)
    if as_int(value) is not None and len(text) > 30:
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[:4]}...{digits[-3:]} ({len(digits)} digits)"
    return text


# -- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against (fixed once the engine is built)."""

    vocab_size: int
    block_size: int
    has_tokenizer: bool
    max_model_len: int
    max_model_len_reason: str  # why max_model_len is what it is, for the error message
    max_num_seqs: int
    max_num_batched_tokens: int  # the token budget of a step
    enable_chunked_prefill: bool
    num_gpu_blocks: int  # the KV pool a request must fit in, alone
    watermark_blocks: int  # blocks of it kept free when admitting prompts
    speculative: bool = False  # speculative decoding is on (beam search is refused)


def check_request_id(request_id, in_use) -> None:
    """A request id is a non-empty string that no unfinished request (``in_use``) has."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if request_id in in_use:
        raise ValueError(f"request id {request_id!r} is already in use")


def as_arrival_time(arrival_time) -> float:
    """``arrival_time`` as float seconds (``time.monotonic()``); None: now."""
    if arrival_time is None:
        return time.monotonic()
    if as_number(arrival_time) is None:
        raise ValueError(f"arrival_time must be a finite number (seconds), got "
                         f"{shown(arrival_time)}")
    return float(as_number(arrival_time))


def encode_prompt(tokenizer, prompt) -> list[int]:
    """The prompt's token ids (ValueError without a tokenizer, or for a prompt not a string)."""
    if tokenizer is None:
        raise ValueError("this model directory has no tokenizer files: pass "
                         "prompt_token_ids, or a tokenizer=")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    return tokenizer.encode(prompt)


def max_blocks_needed(prompt_len: int, params, limits: RequestLimits) -> int:
    """The most GPU blocks one request can ever hold at once.

    Args:
        prompt_len: the prompt's tokens.
        params: its ``SamplingParams``: ``max_tokens`` and ``best_of`` (its sequences share
            the prompt's full blocks).
        limits: the engine's ``max_model_len`` and ``block_size``.
    """
    bs = limits.block_size
    total = min(prompt_len + params.max_tokens, limits.max_model_len)
    shared = prompt_len // bs if params.best_of > 1 else 0
    per_seq = math.ceil((total - shared * bs) / bs)
    return shared + params.best_of * per_seq


def validate_request(prompt_token_ids: list[int], params, limits: RequestLimits) -> None:
    """Raise ValueError if this request could never run; do nothing else.

    Args:
        prompt_token_ids: the prompt, a list of Python ints.
        params: its ``SamplingParams`` (checked again: a field may have changed; the caller
            checked that it is one).
        limits: the engine's limits, its KV pool among them.
    """
    params.verify()  # again: a field may have been changed since construction
    max_model_len, vocab_size = limits.max_model_len, limits.vocab_size
    n = len(prompt_token_ids)
    if not isinstance(prompt_token_ids, list):
        raise ValueError(f"prompt_token_ids must be a list of integers, got "
                         f"{type(prompt_token_ids).__name__}")
    if n == 0:
        raise ValueError("prompt is empty: give at least one token")
    if n >= max_model_len:
        raise ValueError(f"prompt is {n} tokens long; the maximum length is "
                         f"{max_model_len} tokens ({limits.max_model_len_reason}), "
                         f"prompt plus at least one new token")
    bad = [t for t in prompt_token_ids
           if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), "
                         f"got {bad[:5]}")
    if params.stop_strings and not limits.has_tokenizer:
        raise ValueError("stop strings need a tokenizer, and this model has none: pass "
                         "tokenizer=, or stop on token ids with max_tokens")
    max_seqs = limits.max_num_seqs
    if not limits.enable_chunked_prefill:  # decodes wait for the budget too
        max_seqs = min(max_seqs, limits.max_num_batched_tokens)
    if params.best_of > max_seqs:
        raise ValueError(f"best_of ({params.best_of}) is more than the engine runs at once "
                         f"(max_num_seqs {limits.max_num_seqs}, "
                         f"max_num_batched_tokens {limits.max_num_batched_tokens})")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs must be at most the vocabulary size "
                         f"({vocab_size}), got {params.logprobs}")
    if limits.speculative and params.use_beam_search:
        raise ValueError("use_beam_search: beam search does not run with speculative "
                         "decoding (speculative_config is set)")
    need = max_blocks_needed(n, params, limits)
    room = limits.num_gpu_blocks - limits.watermark_blocks
    if need > room:
        raise ValueError(
            f"request can never fit in the KV pool: it may need {need} blocks of "
            f"{limits.block_size} tokens (prompt {n} + max_tokens {params.max_tokens}, "
            f"best_of {params.best_of}) but the pool has {room} usable blocks "
            f"({limits.num_gpu_blocks} minus "
            f"{limits.watermark_blocks} kept free by the watermark); lower "
            f"max_tokens or best_of, or give a larger pool")
