"""An 8-bit KV cache: what is stored, and how a key or value is quantized (lesson 18).

``kv_cache_dtype`` (vLLM's setting and values) chooses what the cache holds:

- ``"auto"``: the model's dtype, no scales;
- ``"fp8"``: float8 e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, largest
  value 448) and one float32 scale per token and kv head;
- ``"int8"``: int8 in [-127, 127] and one float32 scale per token and kv head.

A token's key (or value) for one kv head is ``head_size`` numbers; its scale is their largest
magnitude divided by the format's largest value, so the largest number lands on the format's
largest code and nothing overflows::

    scale = max(|x|) / QMAX         (1 where x is all zeros)
    q     = to_8bit(x / scale)      (fp8: round to nearest even; int8: round half to even)
    x'    = float(q) * scale        (what attention reads)

NOTE: per token and kv head, not one scale per tensor as vLLM's default: a per-tensor scale
must be calibrated on real activations ahead of time, and an outlier token then costs every
other token its precision (``benchmarks/kv_quant_error.py`` measures both on SmolLM2's keys and
values). Four bytes of scale per ``head_size`` bytes of data is the price (6 % at 64).

The scales live beside the cache, one tensor per layer for keys and one for values, shaped
``[num_blocks, num_kv_heads, block_size]``: a block's scales move with it when it is swapped
or copied.
"""
from __future__ import annotations

import torch

from minipaged.config import KV_CACHE_DTYPES
STORAGE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}  # the largest code of each format
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4


def check_kv_cache_dtype(value) -> str:
    """``value`` if it is one of ``KV_CACHE_DTYPES``, else a ValueError listing them."""
    if isinstance(value, str) and value in KV_CACHE_DTYPES:
        return value
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                     f"got {value!r}")


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache tensors: the model's for "auto", else the 8-bit format."""
    return model_dtype if kv_cache_dtype == "auto" else STORAGE[check_kv_cache_dtype(kv_cache_dtype)]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds 8-bit codes with scales beside it."""
    return dtype in QMAX


def element_and_scale_bytes(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one cached number, bytes of the scale stored with each vector) for a cache of
    ``kv_cache_dtype``: what ``model_shape.kv_bytes_per_token`` takes.

    Args:
        kv_cache_dtype: "auto", "fp8" or "int8".
        model_dtype: the model's dtype (what "auto" stores).
    """
    dtype = storage_dtype(kv_cache_dtype, model_dtype)
    element = torch.tensor([], dtype=dtype).element_size()
    return element, (SCALE_BYTES if is_quantized(dtype) else 0)


def bytes_per_token_per_head(head_size: int, kv_cache_dtype: str,
                             model_dtype: torch.dtype) -> int:
    """Bytes one token's key (or value) of one kv head takes in the cache, scale included.

    Args:
        head_size: numbers per head.
        kv_cache_dtype: "auto", "fp8" or "int8".
        model_dtype: the model's dtype (what "auto" stores).
    """
    element, scale = element_and_scale_bytes(kv_cache_dtype, model_dtype)
    return head_size * element + scale


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes and their scales, one scale per vector of the last dimension.

    Args:
        x: (..., head_size), any float dtype.
        dtype: ``torch.float8_e4m3fn`` or ``torch.int8``.

    Returns:
        codes (..., head_size) of ``dtype``, scales (...) float32.
    """
    qmax = QMAX[dtype]
    x = x.float()  # (..., D)
    amax = x.abs().amax(dim=-1)  # (...)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # (...)
    # NOTE: a true division, not a multiply by 1 / scale: the C++ and CUDA code divide too, so
    # every back-end rounds the same way. The clamp only guards rounding at the top code.
    y = (x / scale[..., None]).clamp(-qmax, qmax)  # (..., D)
    if dtype == torch.int8:
        y = torch.round(y)  # half to even, as nearbyint / __float2int_rn
    return y.to(dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values back from codes (..., D) and their scales (...)."""
    return codes.float() * scale[..., None]  # (..., D)


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as an 8-bit cache of ``dtype`` gives it back (in ``x``'s dtype)."""
    return dequantize(*quantize(x, dtype)).to(x.dtype)
