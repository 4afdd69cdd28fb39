"""Lesson 18 exercises: quantize one token's key (or value) vector for an 8-bit KV cache, and
dequantize a block of 4-bit weights as a GGUF file stores them.

    quantize_vector(x, fmt) -> (codes, scale)
        x: a 1-D float32 tensor (one kv head's key or value of one token); fmt "int8" or "fp8".
        scale = max |x| / the format's largest code (127 for int8, 448 for fp8 e4m3), or 1.0
        when x is all zeros; codes = x / scale, clamped to [-largest, largest], then
        int8: rounded half to even (torch.round) and stored as torch.int8;
        fp8:  stored as torch.float8_e4m3fn (the conversion rounds to nearest even).
        Returns the codes tensor and the scale as a Python float.

Expected answer: ``minipaged.kernels.kv_quant.quantize`` (what the engine's cache stores).

    dequantize_q4_1(blocks) -> weights                       (a build-track component)
        blocks: uint8 (n, 20), n Q4_1 blocks: bytes 0-1 d and bytes 2-3 m (float16), then 16
            bytes of 4-bit codes: byte i's low 4 bits are weight i's code, its high 4 bits
            weight i + 16's.
        Returns float32 (n, 32): weight j = d * code_j + m, computed in float32.

Checked bit for bit against the ``gguf`` package's reference (``gguf.quants.dequantize``) on
random blocks; plugged in, it is what ``quantization="gguf"`` dequantizes Q4_1 with
(``kernels/gguf_blocks.py``).
"""
from __future__ import annotations

import torch

from minipaged.exercises import checking, workbench
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, fail_if_changed,
                                          passed, rng_for)
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


# -- dequantize_q4_1: a GGUF weight block (the build track) ---------------------------------------
Q4_1 = "dequantize_q4_1"


def _q4_1_blocks(rng, case: int):
    """Random Q4_1 blocks as numpy uint8 (n, 20): any codes, finite scales; every third case
    blocks the ``gguf`` package quantized from random weights (as a file holds them)."""
    import gguf
    import numpy as np

    n = rng.choice([1, 2, 3, 8])
    seeded = np.random.default_rng(rng.randrange(2**31))
    if case % 3 == 2:
        weights = seeded.standard_normal((n, 32)).astype(np.float32) * 10 ** rng.uniform(-3, 1)
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1).reshape(n, 20)
    raw = seeded.integers(0, 256, (n, 20), dtype=np.uint8)
    scales = (seeded.standard_normal((n, 2)) * 10 ** rng.uniform(-4, 1)).astype(np.float16)
    raw[:, :4] = scales.view(np.uint8).reshape(n, 4)
    return raw


def _q4_1_mistakes(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weights that the usual mistakes give, each with the hint that names it."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # (n, 1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    codes = blocks[:, 4:]  # (n, 16)
    low, high = codes & 0x0F, codes >> 4
    split = torch.cat([low, high], dim=1).float()  # the file's order
    return {
        "the low 4 bits of byte i are weight i, the high 4 bits weight i + 16 (yours has the "
        "halves the other way round)": d * torch.cat([high, low], dim=1).float() + m,
        "byte i holds weights i and i + 16, not two neighbours: the low nibbles of all 16 bytes "
        "come first, then the high nibbles": d * torch.stack([low, high], 2).reshape(
            -1, 32).float() + m,
        "the min is added after the scale: d * code + m, not d * (code + m)": d * (split + m),
        "d is the first float16 (bytes 0-1) and m the second (bytes 2-3)": m * split + d,
        "multiply in float32: convert d and m from float16 first (float16 products round)":
        (d.half() * split.half() + m.half()).float(),
    }


def _check_dequantize_q4_1(candidate, rng, num_cases: int) -> int:
    import gguf

    for case in range(num_cases):
        raw = _q4_1_blocks(rng, case)
        n = raw.shape[0]
        want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
        blocks = torch.from_numpy(raw.copy())
        inputs = f"{n} block(s), the first: d={float(blocks[0, :2].view(torch.float16)):.4g}, "\
                 f"m={float(blocks[0, 2:4].view(torch.float16)):.4g}, codes bytes " \
                 f"{blocks[0, 4:8].tolist()}..."
        given = blocks.clone()
        got = candidate(given)
        fail_if_changed(Q4_1, case, inputs, (given,), (blocks,), ("blocks",),
                        "an in-place operation such as >>= or &= on a slice of them writes into "
                        "the blocks themselves",
                        "the engine passes the model's own weights, so compute into new tensors")
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            fail(Q4_1, case, inputs, shape, tuple(want.shape),
                 "a Q4_1 block is 20 bytes: d and m (2 bytes each), then 16 bytes of codes for "
                 "32 weights; return one row of 32 weights per block")
        if got.dtype != torch.float32:
            fail(Q4_1, case, inputs, got.dtype, torch.float32, "the weights are float32")
        if not torch.equal(got, want):
            row = int((got != want).any(dim=1).nonzero()[0, 0])
            hint = next((why for why, mistake in _q4_1_mistakes(blocks).items()
                         if torch.equal(got, mistake)),
                        "each weight is d * code + m, in float32, the codes in the file's order")
            fail(Q4_1, case, inputs + f" (block {row}, first 6 weights)",
                 [float(f"{x:.4g}") for x in got[row, :6].tolist()],
                 [float(f"{x:.4g}") for x in want[row, :6].tolist()], hint)
    return num_cases


workbench.register(workbench.Component(
    name=Q4_1, lesson="18", slots=("minipaged.kernels.gguf_blocks:dequantize_q4_1",),
    check=_check_dequantize_q4_1, solution="minipaged.exercises.answers.lesson18:dequantize_q4_1",
    preamble="import torch\n\nfrom minipaged.exercises.checking import not_done",
    num_cases=60))


__all__ = ["check_quantize_vector", "usable_quantize_vector"]
