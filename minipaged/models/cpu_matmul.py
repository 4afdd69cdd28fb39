"""Which routine runs a linear layer's matmul on the CPU: the fastest on this machine (lesson 15).

A linear layer computes ``y = x W^T`` for ``x`` of (rows, in) and ``W`` of (out, in). The same
numbers come out of three routines that torch ships, and which is fastest depends on the CPU,
the library and the shape:

- ``xw``: ``F.linear`` (BLAS, MKL on x86), torch's default;
- ``wx``: ``(W x^T)^T``, the operands the other way round, so BLAS picks another kernel;
- ``onednn``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``), where torch has it;
- ``cpp``: minipaged's own loop for a few rows (``csrc/cpu/linear.cpp``, part of the C++ CPU
  op), float32, where the op is loaded and the step has at most ``CPP_MAX_ROWS`` rows.

On the 2-core AMD EPYC (AVX2) of 2026-11-29, SmolLM2's MLP matmul (3,072 x 576) took 6.3 ms
(xw), 4.5 ms (wx) and 4.1 ms (onednn) for a decode step of 64 rows; for 4,096 rows (a prompt)
225, 291 and 218 ms. The libraries are made for big matrices: for a few rows they spend their
time rearranging the weights, and ``cpp`` ran 8 rows of the 576 x 1536 down projection in
0.36 ms against 0.54 ms for the best of the three (benchmarks/linear.py). So nothing is assumed:
the first time a shape is seen (the weight's, the rows rounded up (``_bucket``), the dtype,
torch's thread count and whether the C++ op is loaded) each routine runs on the real input, in
turn, and the fastest is kept for that shape for the rest of the process (``choices``). Every
step of more than ``MAX_ROWS`` rows is one shape, measured on its first ``MAX_ROWS`` rows.

One row (a decode step of one sequence) is not measured: the routines' times differ by a few
hundredths of a millisecond there, and a measurement that small, on weights still in the cache
from its own runs, once picked one with which a 32-token request took 4.85 s against 3.51 s
(benchmarks/threads.py). It takes ``cpp`` where the op is loaded (one pass over the weights:
a 64-token request of SmolLM2 took 3.07 s against 4.73 s with ``F.linear``, 2026-11-29), else
``F.linear``. The routines agree up to float rounding (the same products, summed in each
kernel's order: about 1e-6 of the result's size). On a GPU nothing is measured; the setting
``MINIPAGED_LINEAR_FORM=xw`` (or ``wx``, ``onednn``, ``cpp``) fixes the routine on the CPU too
(``cpp`` where the C++ op is loaded and the tensors are float32; ``F.linear`` otherwise).
A weight kept as a GGUF file's blocks (``quantization="gguf"``) runs its own routines
(``models/gguf_linear.py``).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from minipaged.kernels import build
from minipaged.models.gguf_linear import GGUFWeight
from minipaged.validation import env_choice

MAX_ROWS = 1024  # larger steps share one choice, measured on this many rows
CPP_MAX_ROWS = 256  # ``cpp`` keeps the rows in the cache: a candidate up to this many
TRIES = 2  # runs of each routine per measurement; the fastest run of each counts


def _xw(x, weight):
    return F.linear(x, weight)


def _wx(x, weight):
    return (weight @ x.t()).t().contiguous()  # (rows, out), laid out as x W^T's


def _onednn(x, weight):
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def _cpp_takes(x, weight) -> bool:
    """Whether ``cpp`` takes these tensors: float32, the weight contiguous."""
    return x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()


def _cpp(x, weight):
    op = build.CPU_OP.ready()  # (loaded, never waited for)
    if op is None or not _cpp_takes(x, weight):
        raise NotImplementedError("the C++ CPU op is not loaded, or not float32")
    return op.linear(x, weight)


ROUTINES = {"xw": _xw, "wx": _wx, "onednn": _onednn, "cpp": _cpp}

# (rows rounded up by ``_bucket``, out, in, dtype, threads, whether the C++ op is loaded)
# -> the routine's name. (A first step may run while the op compiles: its shapes are measured
# again once it is loaded.)
choices: dict[tuple, str] = {}


def _bucket(rows: int) -> int:
    """``rows`` rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ... (every step of more than
    ``MAX_ROWS`` rows: one bucket). Halfway steps, because a routine that wins at 64 rows can
    lose at 33: on 2026-11-29 decode steps of 32-39 sequences took 370 ms with powers of two,
    against 249 ms for 24-31."""
    rows = min(rows, MAX_ROWS + 1)
    power = 1 << (rows - 1).bit_length()
    return power * 3 // 4 if rows <= power * 3 // 4 else power


def _forced() -> str | None:
    return env_choice("MINIPAGED_LINEAR_FORM", ROUTINES)


def _fastest(x: torch.Tensor, weight: torch.Tensor) -> str:
    x = x[:MAX_ROWS]
    best = {}
    if x.shape[0] > CPP_MAX_ROWS:
        best["cpp"] = float("inf")  # (made for a few rows)
    for _ in range(TRIES):
        for name, routine in ROUTINES.items():  # in turn: a load that comes and goes hits all
            if best.get(name) == float("inf"):
                continue
            t0 = time.perf_counter()
            try:
                routine(x, weight)
            except (RuntimeError, AttributeError, NotImplementedError, TypeError):
                best[name] = float("inf")  # not in this build of torch, or not for this dtype
                continue
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return min(best, key=best.get)  # (xw first: it wins a tie)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the CPU by the routine that is fastest here (above).

    Args:
        x: (rows, in) or (..., in).
        weight: (out, in).
        bias: None or (out,).
    """
    if isinstance(weight, GGUFWeight):  # a GGUF file's blocks: their own routines
        out = weight.linear(x)
        return out if bias is None else out + bias
    name = _forced()
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] == 0 or torch.is_grad_enabled():
        return F.linear(x, weight, bias)  # (autograd: the routines need not all support it)
    op = build.CPU_OP.ready()  # (looked up once a call: the choice's key and ``cpp`` use it)
    if name is None and x.shape[0] == 1:
        name = "cpp"  # (not measured: see above)
    if name is None:
        key = (_bucket(x.shape[0]), *weight.shape, weight.dtype, torch.get_num_threads(),
               op is not None)
        name = choices.get(key)
        if name is None:
            name = choices[key] = _fastest(x, weight)
    if name == "cpp":
        runs = op is not None and _cpp_takes(x, weight)
        out = op.linear(x, weight) if runs else F.linear(x, weight)
        return out if bias is None else out + bias
    if name == "xw":
        return F.linear(x, weight, bias)
    out = ROUTINES[name](x, weight)
    return out if bias is None else out + bias
