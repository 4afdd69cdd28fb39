"""Parsers for what users pass in: integers, finite numbers, token ids (lesson 08).

Each turns numpy and torch scalars into Python numbers and says None (or raises a ValueError that
names the value) when the input is not of the kind asked for. The checks built on them live with
what they check: engine settings in ``minipaged/config.py``, sampling values in
``SamplingParams.verify``, requests in ``minipaged/engine/validation.py``. The rule they serve:
bad input never hangs the engine or reaches the middle of a step.
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
