"""Lesson 18 exercise: quantize one token's key (or value) vector for an 8-bit KV cache.

    quantize_vector(x, fmt) -> (codes, scale)
        x: a 1-D float32 tensor (one kv head's key or value of one token); fmt "int8" or "fp8".
        scale = max |x| / the format's largest code (127 for int8, 448 for fp8 e4m3), or 1.0
        when x is all zeros; codes = x / scale, clamped to [-largest, largest], then
        int8: rounded half to even (torch.round) and stored as torch.int8;
        fp8:  stored as torch.float8_e4m3fn (the conversion rounds to nearest even).
        Returns the codes tensor and the scale as a Python float.

Expected answer: ``minipaged.kernels.kv_quant.quantize`` (what the engine's cache stores).
"""
from __future__ import annotations

import torch

from minipaged.exercises import checking
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.kernels import kv_quant

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _case(rng, case: int) -> torch.Tensor:
    n = rng.choice([8, 16, 64, 128])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(n, generator=g) * 10 ** rng.uniform(-4, 3)  # (n,)
    if case % 7 == 3:
        x[rng.randrange(n)] *= 50  # an outlier
    if case % 11 == 5:
        x = torch.zeros(n)  # an all-zero vector
    if case % 13 == 8:  # the largest magnitude already on the largest code: ties appear
        x = torch.round(torch.randn(n, generator=g) * 40) / 2
        x[0] = 127.0
    return x


def _as_bits(codes: torch.Tensor) -> list[int]:
    return codes.view(torch.uint8).tolist() if codes.element_size() == 1 else []


@exercise
def check_quantize_vector(fn, num_cases: int = 120, seed: int | None = 0) -> CheckResult:
    learner = Learner("quantize_vector", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        fmt = "int8" if case % 2 == 0 else "fp8"
        x = _case(rng, case)
        codes, scale = kv_quant.quantize(x, FORMATS[fmt])  # (n,), ()
        expected = (codes.float().tolist(), float(scale))
        got = learner(x.clone(), fmt)
        ok = (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)
              and got[0].dtype == FORMATS[fmt] and got[0].shape == x.shape
              and isinstance(got[1], float) and got[1] == expected[1]
              and _as_bits(got[0]) == _as_bits(codes))
        if not ok:
            shown = (got[0].float().tolist(), got[1]) if (
                isinstance(got, tuple) and len(got) == 2
                and isinstance(got[0], torch.Tensor)) else got
            hint = _hint(got, x, fmt, scale)
            fail(learner.name, case, f"x={x.tolist()}, fmt={fmt!r}", shown, expected, hint)
    return passed(learner, num_cases)


def _hint(got, x, fmt, scale) -> str:
    dtype = FORMATS[fmt]
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)):
        return "return a pair: (codes tensor, scale as a Python float)"
    codes, s = got
    if codes.dtype != dtype:
        return f"the codes of {fmt} are stored as {dtype}"
    if not isinstance(s, float):
        return "give the scale as a Python float (float(...))"
    if not x.abs().max() > 0:
        return "an all-zero vector has no largest magnitude: its scale is 1.0, its codes 0"
    if s != float(scale):
        if abs(s - float(1 / scale)) <= 1e-6 * abs(float(1 / scale)):
            return "the scale multiplies a code back into x: largest |x| / largest code"
        return (f"one scale per vector: its largest magnitude divided by the largest {fmt} code "
                f"({int(kv_quant.QMAX[dtype])})")
    return ("divide x by the scale (not multiply by 1 / scale: that rounds differently), clamp "
            "to the format's range, and for int8 round half to even with torch.round before "
            "converting")


def _package_quantize_vector(x, fmt):
    codes, scale = kv_quant.quantize(x, FORMATS[fmt])
    return codes, float(scale)


def usable_quantize_vector(fn):
    """``fn`` once its check passed; until then the package's ``kv_quant.quantize``."""
    return checking.usable("quantize_vector", fn, _package_quantize_vector)


__all__ = ["check_quantize_vector", "usable_quantize_vector"]
