"""Is this request one the engine can run? Checked once, before it is queued (lesson 08).

A request that could never run (too long for the model, too large for the KV pool, a stop string
without a tokenizer, ...) is refused with a ValueError that says what to change, so that an
accepted request always finishes. ``LLMEngine.add_request`` and ``LLMEngine.validate_request``
(which the server and ``LLM.generate`` call) use ``validate_request`` here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler import SchedulerConfig
from minipaged.sampling_params import SamplingParams
from minipaged.validation import as_number, shown


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against (fixed once the engine is built)."""

    vocab_size: int
    block_size: int
    has_tokenizer: bool
    max_model_len_reason: str  # why max_model_len is what it is, for the error message
    scheduler_config: SchedulerConfig  # max_model_len, max_num_seqs, the token budget


def check_request_id(request_id, in_use) -> None:
    """A request id is a non-empty string that no unfinished request (``in_use``) has."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if request_id in in_use:
        raise ValueError(f"request id {request_id!r} is already in use")


def as_arrival_time(arrival_time) -> float | None:
    """``arrival_time`` as float seconds (None stays None: the engine takes the time of day)."""
    if arrival_time is None:
        return None
    if as_number(arrival_time) is None:
        raise ValueError(f"arrival_time must be a finite number (seconds), got "
                         f"{shown(arrival_time)}")
    return float(as_number(arrival_time))


def max_blocks_needed(prompt_len: int, params: SamplingParams, limits: RequestLimits) -> int:
    """The most GPU blocks one request can ever hold at once.

    Args:
        prompt_len: the prompt's tokens.
        params: its ``max_tokens`` and ``best_of`` (its sequences share the prompt's full
            blocks).
        limits: the engine's ``max_model_len`` and ``block_size``.
    """
    bs = limits.block_size
    total = min(prompt_len + params.max_tokens, limits.scheduler_config.max_model_len)
    shared = prompt_len // bs if params.best_of > 1 else 0
    per_seq = math.ceil((total - shared * bs) / bs)
    return shared + params.best_of * per_seq


def validate_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits,
                     block_manager: BlockSpaceManager) -> None:
    """Raise ValueError if this request could never run; do nothing else.

    Args:
        prompt_token_ids: the prompt, a list of Python ints.
        params: its sampling parameters (checked again: a field may have changed).
        limits: the engine's limits.
        block_manager: the KV pool the request must fit in, alone.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params)}")
    params.verify()  # again: a field may have been changed since construction
    sched = limits.scheduler_config
    max_model_len, vocab_size = sched.max_model_len, limits.vocab_size
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
    max_seqs = sched.max_num_seqs
    if not sched.enable_chunked_prefill:  # decodes wait for the budget too
        max_seqs = min(max_seqs, sched.max_num_batched_tokens)
    if params.best_of > max_seqs:
        raise ValueError(f"best_of ({params.best_of}) is more than the engine runs at once "
                         f"(max_num_seqs {sched.max_num_seqs}, "
                         f"max_num_batched_tokens {sched.max_num_batched_tokens})")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs must be at most the vocabulary size "
                         f"({vocab_size}), got {params.logprobs}")
    need = max_blocks_needed(n, params, limits)
    room = block_manager.num_total_gpu_blocks - block_manager.watermark_blocks
    if need > room:
        raise ValueError(
            f"request can never fit in the KV pool: it may need {need} blocks of "
            f"{limits.block_size} tokens (prompt {n} + max_tokens {params.max_tokens}, "
            f"best_of {params.best_of}) but the pool has {room} usable blocks "
            f"({block_manager.num_total_gpu_blocks} minus "
            f"{block_manager.watermark_blocks} kept free by the watermark); lower "
            f"max_tokens or best_of, or give a larger pool")
