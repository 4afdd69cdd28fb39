"""A weight matrix kept as the GGUF file stores it, and its matmul.

``GGUFWeight`` holds a linear layer's weight (out, in) as the file's rows of blocks
(``kernels/gguf_blocks.py``: Q8_0, Q4_1, Q5_0, Q4_K, Q6_K), never as float32: the embedded
SmolLM2's layers take 0.625 bytes a weight (Q4_1) instead of 4. ``linear(x)`` computes ``x W^T``
by one of five routines:

- ``cpp``: our C++ op reads the blocks and dequantizes each inside the dot product (float32
  inputs, where the C++ CPU op is loaded): ``csrc/cpu/gguf_linear.cpp`` for Q8_0, Q4_1 and Q5_0,
  ``csrc/cpu/gguf_kquants.cpp`` for Q4_K and Q6_K;
- ``int4pack``: torch's weight-only 4-bit kernel (``torch._weight_int4pack_mm_for_cpu``), for
  Q4_1, whose weights ``d * q + m`` map exactly onto torch's ``(q - 8) * scale + zero`` with
  ``scale = d`` and ``zero = m + 8 d`` (a copy of the codes in torch's packed layout is made);
- ``tiles``: our C++ op dequantizes a few weight rows at a time into a buffer that stays in
  the cache and runs the few-row float32 loop of ``csrc/cpu/linear.cpp`` on them (Q8_0, Q4_1,
  Q5_0): for a batch of rows, whose blocks it decodes once, not once per 4 rows;
- ``cuda``: on a GPU, our CUDA kernel (``csrc/gguf_matmul.cu``: a warp per weight row
  dequantizes the blocks inside the dot product; every format, float32, float16 and bfloat16 x);
- ``dequant``: the blocks of a tile of rows dequantized (by the C++ op for Q8_0, Q4_1 and Q5_0,
  else in torch: the same values), then ``F.linear`` (any format, anywhere: the fallback).

Which one runs is measured once per weight shape and format when the model is loaded
(``choose_routine``), on one input row: a decode step, the step whose time is the weights' bytes
(``dequant`` only where neither other routine runs: it does their work and more).
(``int4pack`` is not measured per number of rows, as ``cpu_matmul`` does: two layouts of the
weights would be held, and the memory saved would be lost.) Where ``cpp`` was chosen, a step of
several rows (a batch of decodes) runs ``cpp``, ``tiles`` or ``dequant``, measured once per
number of rows (``_routine_for_rows``), and a step of more than ``CPP_MAX_ROWS`` rows (a prompt)
runs ``dequant``. On a GPU the same two measurements choose between ``cuda`` and ``dequant``
(one row when the model is loaded; then once per power of two of rows, up to ``CPP_MAX_ROWS``).
``MINIPAGED_GGUF_ROUTINE`` fixes the routine where it can run, for every number of rows.

The routines agree up to float rounding with ``F.linear(x, dequantize())``
(tests/models/test_gguf_linear.py).
"""
from __future__ import annotations

import time
from functools import partial

import torch
import torch.nn.functional as F

from minipaged.kernels import build
from minipaged.kernels.gguf_blocks import BlockFormat, block_format, dequantize
from minipaged.validation import env_choice

CPP_MAX_ROWS = 256  # more rows than this: BLAS on dequantized tiles (CPU and GPU)
# float32 weights ``dequant`` makes at once (16 MB): SmolLM2's matrices whole, its head in four.
# NOTE: not 512 rows at a time: a prompt's step then ran as many small matmuls and a cat of
# their outputs, 40 % slower than float32's one matmul (2026-12-07, the 64-request trace)
TILE_WEIGHTS = 1 << 22
ROUTINES = ("cpp", "int4pack", "dequant", "tiles", "cuda")
# a one-row routine -> the routines measured for a step of several rows (``_routine_for_rows``)
ROW_ROUTINES = {"cpp": ("cpp", "tiles", "dequant"), "cuda": ("cuda", "dequant")}
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # x's dtypes the CUDA kernel takes
CPP_FORMATS = ("Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")  # the formats the C++ op reads
KQUANTS = ("Q4_K", "Q6_K")  # ... of them, those of csrc/cpu/gguf_kquants.cpp (256 weights a block)

# (out, in, format, threads or the GPU's dtype, whether the C++ op is loaded) -> the routine
# measured fastest
choices: dict[tuple, str] = {}
# (rows rounded up to a power of two, out, in, format, threads or x's dtype on a GPU) -> the
# routine for a step of several rows, where one row's is ``cpp`` or ``cuda``
# (``GGUFWeight._routine_for_rows``)
row_choices: dict[tuple, str] = {}
DEQUANTIZE_FORMATS = ("Q8_0", "Q4_1", "Q5_0")  # those the C++ op dequantizes (gguf_dequantize)
_ORIGINAL_DEQUANTIZE = {name: block_format(name).dequantize for name in DEQUANTIZE_FORMATS}


class GGUFWeight:
    """A weight (out, in) as rows of GGUF blocks.

    Args:
        blocks: uint8 (out, bytes per row), each row its ``in / fmt.weights`` blocks.
        fmt: the block format.
        dtype: the model's dtype: an embedding's rows come in it (a matmul's result comes in
            its input's dtype).
    """

    def __init__(self, blocks: torch.Tensor, fmt: BlockFormat,
                 dtype: torch.dtype = torch.float32) -> None:
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % fmt.bytes:
            raise ValueError(f"{fmt.name} blocks must be uint8 (out, a multiple of {fmt.bytes}"
                             f" bytes), got {blocks.dtype} {tuple(blocks.shape)}")
        self.blocks = blocks.contiguous()
        self.fmt = fmt
        self.dtype = dtype
        self.shape = torch.Size((blocks.shape[0], blocks.shape[1] // fmt.bytes * fmt.weights))
        self.routine = "dequant"
        self._int4 = None  # (packed codes, scales and zeros) once ``int4pack`` is chosen

    def __repr__(self) -> str:
        return f"GGUFWeight({self.fmt.name}, {tuple(self.shape)}, {self.routine})"

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this weight holds: its blocks, and torch's packed copy where chosen."""
        return [self.blocks, *(self._int4 or ())]

    def data_ptr(self) -> int:
        return self.blocks.data_ptr()

    def numel(self) -> int:
        """The weights it holds (as a float tensor's ``numel``: lab/step_breakdown counts them)."""
        return self.shape.numel()

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 (out, in): the values transformers' GGUF loader produces."""
        return dequantize(self.blocks, self.fmt)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` dequantized, (len(index), in), in the model's dtype: an embedding's
        lookup."""
        return dequantize(self.blocks.index_select(0, index.reshape(-1)),
                          self.fmt).to(self.dtype)

    def split_rows(self, sizes: list[int]) -> list[GGUFWeight]:
        """Consecutive row ranges as weights of their own, views of these blocks."""
        return [GGUFWeight(part, self.fmt, self.dtype) for part in self.blocks.split(sizes)]

    @staticmethod
    def cat(weights: list[GGUFWeight]) -> GGUFWeight:
        """One weight with the rows of ``weights`` in turn (a fused q/k/v or gate/up)."""
        fmt = weights[0].fmt
        if any(w.fmt != fmt or w.shape[1] != weights[0].shape[1] for w in weights):
            raise ValueError("fused GGUF weights must share their format and input size: "
                             + ", ".join(repr(w) for w in weights))
        return GGUFWeight(torch.cat([w.blocks for w in weights]), fmt, weights[0].dtype)

    # -- the routines ------------------------------------------------------------------------
    def runs(self, routine: str, x: torch.Tensor | None = None) -> bool:
        """Whether ``routine`` can compute this weight's matmul here (for ``x``, if given)."""
        if routine == "dequant":
            return True
        if routine == "cuda":
            return (self.fmt.name in CPP_FORMATS and _cuda_op(self.blocks.device) is not None
                    and (x is None or (x.device == self.blocks.device and x.dtype in CUDA_DTYPES
                                       and x.shape[-1] == self.shape[1])))
        if x is not None and (x.dtype != torch.float32 or x.device.type != "cpu"):
            return False
        if routine == "cpp":
            return self.fmt.name in CPP_FORMATS and build.CPU_OP.ready() is not None
        if routine == "tiles":
            return self.fmt.name in DEQUANTIZE_FORMATS and build.CPU_OP.ready() is not None
        if routine == "int4pack":
            return (self.fmt.name == "Q4_1" and self.shape[0] % 16 == 0  # (torch's layout)
                    and hasattr(torch, "_weight_int4pack_mm_for_cpu"))
        return False

    def use(self, routine: str) -> None:
        """Run ``routine`` from now on (``int4pack`` packs the codes once)."""
        if routine not in ROUTINES or not self.runs(routine):
            raise ValueError(f"routine {routine!r} cannot run {self!r} here")
        if routine == "int4pack" and self._int4 is None:
            self._int4 = _int4_pack(self.blocks)
        if routine != "int4pack":
            self._int4 = None
        self.routine = routine

    def linear(self, x: torch.Tensor, routine: str | None = None) -> torch.Tensor:
        """``x W^T`` for x (rows, in) (or (..., in)), float32 out for float32 in."""
        if x.dim() != 2:
            return self.linear(x.reshape(-1, x.shape[-1]), routine).reshape(*x.shape[:-1], -1)
        if routine is None:
            routine = self.routine
            if routine in ROW_ROUTINES and x.shape[0] > 1:  # several rows: measured (below)
                routine = self._routine_for_rows(x, routine)
        if routine in ("cpp", "tiles", "cuda") and (x.shape[0] > CPP_MAX_ROWS
                                                    or not self.runs(routine, x)):
            routine = "dequant"
        if routine == "cuda":
            return _cuda_op(self.blocks.device).gguf_linear(x, self.blocks, self.fmt.ggml_type)
        if routine == "int4pack" and not self.runs("int4pack", x):
            routine = "dequant"
        if routine in ("cpp", "tiles"):
            x = x if x.stride(-1) == 1 else x.contiguous()
            module = build.CPU_OP.ready().module
            op = (module.gguf_linear_tiled if routine == "tiles"
                  else module.gguf_kquant_linear if self.fmt.name in KQUANTS
                  else module.gguf_linear)
            return op(x, self.blocks, self.fmt.ggml_type)
        if routine == "int4pack":
            packed, scales_zeros = self._int4 if self._int4 is not None else _int4_pack(
                self.blocks)
            return torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, 32, scales_zeros)
        tiles = [F.linear(x, self._float_rows(part).to(x.dtype))
                 for part in self.blocks.split(max(1, TILE_WEIGHTS // self.shape[1]))]
        return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)

    def _float_rows(self, part: torch.Tensor) -> torch.Tensor:
        """Rows of blocks as float32: by the C++ op where it reads the format (the same
        values, about 10x faster), else by ``kernels/gguf_blocks.py`` (also where lesson 18
        put a learner's dequantization in its place)."""
        op = build.CPU_OP.ready() if part.device.type == "cpu" else None
        if (op is not None and self.fmt.name in DEQUANTIZE_FORMATS
                and self.fmt.dequantize is _ORIGINAL_DEQUANTIZE[self.fmt.name]):
            return op.module.gguf_dequantize(part, self.fmt.ggml_type)
        return dequantize(part, self.fmt)

    def _routine_for_rows(self, x: torch.Tensor, own: str = "cpp") -> str:
        """For a step of x's rows where one row runs ``own``: one of ``ROW_ROUTINES[own]``
        (``cpp``, ``tiles`` or ``dequant``; ``cuda`` or ``dequant`` on a GPU), measured once per
        number of rows (rounded up to a power of two), shape and format. ``cpp`` decodes a block
        once per 4 rows; ``tiles`` once per step, and BLAS on a dequantized matrix wins for many
        rows (2026-12-07, 2 Zen 3 cores, SmolLM2's gate/up, 64 rows: cpp 3.6 ms, tiles 1.4,
        dequant 2.0, float32's F.linear 1.7)."""
        if _forced() is not None or x.shape[0] > CPP_MAX_ROWS or not self.runs(own, x):
            return own  # (the caller's rules apply: the forced routine, dequant past the rows)
        key = (1 << (x.shape[0] - 1).bit_length(), *self.shape, self.fmt.name,
               _where(x.device, x.dtype))  # (rows rounded up to a power of two)
        name = row_choices.get(key)
        if name is None:
            best = {r: float("inf") for r in ROW_ROUTINES[own] if self.runs(r, x)}
            for _ in range(3):
                for routine in best:  # in turn: a load that comes and goes hits both
                    best[routine] = min(best[routine],
                                        _seconds(partial(self.linear, x, routine), x.device))
            name = row_choices[key] = min(best, key=best.get)
        return name


def _int4_pack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 blocks in torch's 4-bit layout: the packed codes and (groups, out, 2) scales/zeros.

    torch dequantizes ``(q - 8) * scale + zero``; Q4_1's ``d * q + m`` is that with ``scale = d``
    and ``zero = m + 8 d``."""
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, 20)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # (out, groups)
    m = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    codes = b[..., 4:]
    q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).reshape(out, -1).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_zeros


def _cuda_op(device: torch.device):
    """Our CUDA kernels where ``device`` is a GPU and they could be built, else None."""
    return build.CUDA_OP.load() if device.type == "cuda" else None


def _where(device: torch.device, dtype: torch.dtype):
    """What a measurement depends on besides the shape: the threads (CPU), x's dtype (GPU)."""
    return torch.get_num_threads() if device.type == "cpu" else str(dtype)


def _seconds(run, device: torch.device) -> float:
    """The wall time of ``run()``, the GPU's queue drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - t0


def _forced() -> str | None:
    return env_choice("MINIPAGED_GGUF_ROUTINE", ROUTINES)


def choose_routine(weight: GGUFWeight, tries: int = 5) -> str:
    """The routine measured fastest for one input row of ``weight``'s shape (kept per shape)."""
    forced = _forced()
    if forced is not None and weight.runs(forced):
        weight.use(forced)
        return forced
    key = (*weight.shape, weight.fmt.name, _where(weight.blocks.device, torch.float32),
           build.CPU_OP.ready() is not None)
    name = choices.get(key)
    if name is None:
        x = torch.randn(1, weight.shape[1], device=weight.blocks.device)
        trials = {}
        # ``dequant`` does ``cpp``'s work and more (it writes the float tile and reads it again):
        # measured only where nothing else runs (a noisy measurement once chose it). On a GPU
        # it is measured against ``cuda``: a matmul there may beat a kernel of our own.
        candidates = (["cuda", "dequant"] if weight.runs("cuda", x) else
                      [r for r in ("cpp", "int4pack") if weight.runs(r, x)] or ["dequant"])
        for routine in candidates:
            if weight.runs(routine, x):
                trials[routine] = GGUFWeight(weight.blocks, weight.fmt, weight.dtype)
                trials[routine].use(routine)
                trials[routine].linear(x)  # (a first run: caches, lazy set-up)
        best = dict.fromkeys(trials, float("inf"))
        for _ in range(tries):
            for routine, trial in trials.items():  # in turn: a load that comes and goes hits all
                best[routine] = min(best[routine], _seconds(partial(trial.linear, x), x.device))
        name = choices[key] = min(best, key=best.get)
    weight.use(name)
    return name
