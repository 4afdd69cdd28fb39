"""Checks on what users pass in, before anything is queued: engine settings and token ids.

A bad value gets a ValueError that names it and says what is allowed (the engine's rule: bad
input never hangs the engine or reaches the middle of a step). Request-level checks that need the
engine's model and pool (``LLMEngine.validate_request``) and ``SamplingParams.verify`` use the
same style.
"""
from __future__ import annotations

import math
import numbers
import operator


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


def shown(value) -> str:
    """``repr(value)`` for an error message, with a huge integer shortened to its magnitude."""
    text = repr(value)
    if as_int(value) is not None and len(text) > 30:
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[:4]}...{digits[-3:]} ({len(digits)} digits)"
    return text


def check_settings(**settings) -> dict:
    """Engine settings: numbers of the right kind and range, or a ValueError naming them.

    Returns the settings with numpy scalars turned into Python numbers."""
    number, integer = as_number, as_int

    def mode(v):  # a PreemptionMode member counts as its name
        v = getattr(v, "value", v)
        return v if isinstance(v, str) and v in ("recompute", "swap") else None

    def device(v) -> bool:
        import torch

        try:
            d = torch.device(v)
        except (RuntimeError, TypeError):
            return False
        return d.type in ("cpu", "cuda")

    rules = {  # name: (convert -> None when bad, check on the converted value, allowed)
        "block_size": (integer, lambda v: v in (1, 2, 4, 8, 16, 32, 64, 128),
                       "a power of two from 1 to 128"),
        "gpu_memory_utilization": (number, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "kv_cache_bytes": (number, lambda v: v > 0, "None or a number of bytes > 0"),
        "swap_space": (number, lambda v: v >= 0, "a finite number of GiB >= 0"),
        "num_gpu_blocks": (integer, lambda v: v >= 1, "None or an integer >= 1"),
        "num_cpu_blocks": (integer, lambda v: v >= 0, "None or an integer >= 0"),
        "max_num_seqs": (integer, lambda v: v >= 1, "an integer >= 1"),
        "max_num_batched_tokens": (integer, lambda v: v >= 1, "None or an integer >= 1"),
        "max_model_len": (integer, lambda v: v >= 2, "None or an integer >= 2"),
        "watermark": (number, lambda v: 0 <= v < 1, "a number in [0, 1)"),
        "seed": (integer, lambda v: True, "an integer"),
        "tensor_parallel_size": (integer, lambda v: v >= 1, "an integer >= 1"),
        "worker_timeout": (number, lambda v: v > 0, "a number of seconds > 0"),
        "enable_prefix_caching": (lambda v: v if isinstance(v, bool) else None, lambda v: True,
                                  "True or False"),
        "enable_chunked_prefill": (lambda v: v if isinstance(v, bool) else None,
                                   lambda v: True, "True or False"),
        "preemption_mode": (mode, lambda v: True, "None, 'recompute' or 'swap'"),
        "device": (lambda v: v if v == "auto" or device(v) else None, lambda v: True,
                   "'auto', 'cpu', 'cuda' or 'cuda:N'"),
    }
    may_be_none = {"kv_cache_bytes", "num_gpu_blocks", "num_cpu_blocks",
                   "max_num_batched_tokens", "max_model_len", "preemption_mode"}
    checked = {}
    for name, value in settings.items():
        convert, check, allowed = rules[name]
        if value is None and name in may_be_none:
            checked[name] = None
            continue
        converted = convert(value)
        if converted is None or not check(converted):
            raise ValueError(f"{name} must be {allowed}, got {shown(value)}")
        checked[name] = converted
    return checked
