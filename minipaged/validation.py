"""Checks on what users pass in, before anything is queued: engine settings and token ids.

A bad value gets a ValueError that names it and says what is allowed (the engine's rule: bad
input never hangs the engine or reaches the middle of a step). Request-level checks that need the
engine's model and pool (``LLMEngine.validate_request``) and ``SamplingParams._verify`` use the
same style.
"""
from __future__ import annotations

import math

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


def check_settings(**settings) -> None:
    """Engine settings: numbers of the right kind and range, or a ValueError naming them."""
    def number(v) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v))

    def integer(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    rules = {  # name: (check, allowed)
        "block_size": (lambda v: v in (1, 2, 4, 8, 16, 32, 64, 128) and integer(v),
                       "a power of two from 1 to 128"),
        "gpu_memory_utilization": (lambda v: number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "kv_cache_bytes": (lambda v: v is None or (number(v) and v > 0),
                           "None or a number of bytes > 0"),
        "swap_space": (lambda v: number(v) and v >= 0, "a number of GiB >= 0"),
        "num_gpu_blocks": (lambda v: v is None or (integer(v) and v >= 1),
                           "None or an integer >= 1"),
        "num_cpu_blocks": (lambda v: v is None or (integer(v) and v >= 0),
                           "None or an integer >= 0"),
        "max_num_seqs": (lambda v: integer(v) and v >= 1, "an integer >= 1"),
        "max_num_batched_tokens": (lambda v: v is None or (integer(v) and v >= 1),
                                   "None or an integer >= 1"),
        "max_model_len": (lambda v: v is None or (integer(v) and v >= 2),
                          "None or an integer >= 2"),
        "watermark": (lambda v: number(v) and 0 <= v < 1, "a number in [0, 1)"),
        "seed": (lambda v: integer(v), "an integer"),
        "enable_prefix_caching": (lambda v: isinstance(v, bool), "True or False"),
        "enable_chunked_prefill": (lambda v: isinstance(v, bool), "True or False"),
    }
    for name, value in settings.items():
        check, allowed = rules[name]
        if not check(value):
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
