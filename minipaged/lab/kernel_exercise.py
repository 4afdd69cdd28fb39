"""Lesson 06's kernel exercise: the learner's phase 3 inside the real kernel, built for the CPU.

``csrc/paged_attention.cu`` marks phase 3 (the softmax) of ``attend`` with two lines,
``// >>> softmax_phase`` and ``// <<< softmax_phase``. ``exercise_source(code)`` is the file
with the learner's ``code`` in place of the lines between them, cut at its
``// >>> end of the exercise build`` line (the V2 kernels and the launch code are not needed),
followed by ``csrc/cuda_on_cpu/exercise_launch.cu``, which launches the V1 kernel for one
shape: fp32, head size 64, block size 16. One line is added after the learner's code: every
thread records the ``max_logit`` and ``exp_sum`` it ends phase 3 with, so that a checker can see
lanes that disagree.

``build(code, sanitizer)`` compiles that translation unit (seconds, not the minutes of the whole
kernel file) with ``-fsanitize=thread`` or ``-fsanitize=address`` and links it with the CPU
CUDA runtime and ``csrc/cuda_on_cpu/exercise_main.cpp``; everything is cached by a digest of
what it is made from (``cuda_on_cpu._digest``), so the same code is never compiled twice. A
compile error raises ``CompileError`` with the compiler's messages about the learner's lines,
which are numbered from 1 as in the learner's cell (``#line``). ``run(program, case)`` runs one
case and returns the output, the per-thread values, and the sanitizer's report, if any.

``build_library(code)`` builds the same translation unit optimised, without a sanitizer, as a
shared library, and ``ExerciseKernel(code).paged_attention`` calls it through ctypes with the
arguments of ``minipaged.kernels.ops.paged_attention``: lesson 16's capstone makes it the
engine's decode attention (``capstone_steps.in_the_kernel``).
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minipaged.cache_paths import extensions_root
from minipaged.kernels import reference
from minipaged.kernels.build import CSRC, CUDA_HEADERS
from minipaged.kernels.cuda_on_cpu import (FLAGS, RUNTIME_DIR, SANITIZERS, _digest,
                                           rewrite_cuda_source, shuffle_steps)

KERNEL = CSRC / "paged_attention.cu"
LAUNCH = RUNTIME_DIR / "exercise_launch.cu"
MAIN = RUNTIME_DIR / "exercise_main.cpp"
LIBRARY_MAIN = RUNTIME_DIR / "exercise_library.cpp"  # the shared library's one extra function
BEGIN, END, CUT = "// >>> softmax_phase", "// <<< softmax_phase", "// >>> end of the exercise build"
LEARNER_FILE = "your_softmax_phase.cu"  # how compiler and sanitizer messages name the learner's code
HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, X = 64, 16, 128, 4  # the one shape the exercise build has
# Written before the kernel: where each thread's end-of-phase-3 values go.
_RECORD = """namespace minipaged { namespace exercise_record {
inline float* thread_max = nullptr;
inline float* thread_sum = nullptr;
} }
#define MP_EXERCISE_RECORD(max_value, sum_value) do { \\
    const int64_t slot_ = ((int64_t)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x; \\
    ::minipaged::exercise_record::thread_max[slot_] = (max_value); \\
    ::minipaged::exercise_record::thread_sum[slot_] = (sum_value); } while (0)
"""


# The phase 3 that ``build`` uses when given none: None is the package's own. The build track's
# component "softmax_phase_cuda" is plugged in here (``workbench.plugged_in``).
PHASE3: str | None = None


class CompileError(RuntimeError):
    """The learner's code does not compile; the message is the compiler's, about their lines."""


def package_phase3() -> str:
    """The package's own phase 3: the lines between the markers."""
    lines = KERNEL.read_text().split("\n")
    begin = next(i for i, line in enumerate(lines) if BEGIN in line)
    end = next(i for i, line in enumerate(lines) if END in line)
    first = begin + 1
    while lines[first].lstrip().startswith("// the lines up to"):  # the marker's second line
        first += 1
    return "\n".join(lines[first:end]) + "\n"


def exercise_source(code: str) -> str:
    """The translation unit: the kernel file with ``code`` as its phase 3, and the launch."""
    lines = KERNEL.read_text().split("\n")
    begin = next(i for i, line in enumerate(lines) if BEGIN in line)
    end = next(i for i, line in enumerate(lines) if END in line)
    cut = next(i for i, line in enumerate(lines) if CUT in line)
    spliced = (lines[:begin + 1] + [f'#line 1 "{LEARNER_FILE}"', *code.rstrip("\n").split("\n"),
                                    f'#line {end + 1} "{KERNEL}"',
                                    "  MP_EXERCISE_RECORD(max_logit, exp_sum);"]
               + lines[end + 1:cut])
    kernel = rewrite_cuda_source("\n".join(spliced), str(KERNEL))
    launch = rewrite_cuda_source(LAUNCH.read_text(), str(LAUNCH))
    return f"#include <cstdint>\n#include <cuda_runtime.h>\n{_RECORD}{kernel}\n{launch}\n"


def _flags(sanitizer: str) -> list[str]:
    return [*FLAGS, "-O1", "-g", *SANITIZERS[sanitizer], f"-I{RUNTIME_DIR / 'include'}",
            f"-I{CSRC}"]


def _compile(source: Path | None, text: str | None, obj: Path, flags: list[str]) -> \
        subprocess.Popen | None:
    """Start compiling ``source`` (or ``text``) into ``obj`` unless it is there already."""
    if obj.exists():
        return None
    args = ["g++", *flags, "-x", "c++", "-c", str(source) if source else "-", "-o", f"{obj}.tmp"]
    process = subprocess.Popen(args, stdin=subprocess.PIPE if text else None,
                               stderr=subprocess.PIPE, text=True)
    if text:
        process.stdin.write(text)
        process.stdin.close()
    return process


def _finish(process: subprocess.Popen | None, obj: Path) -> str | None:
    """Wait for a compile; the compiler's messages if it failed."""
    if process is None:
        return None
    err = process.stderr.read()
    if process.wait():
        return err
    Path(f"{obj}.tmp").rename(obj)
    return None


def learner_messages(err: str) -> str:
    """The compiler's messages that point into the learner's code (all of them if none does)."""
    keep = [line for line in err.splitlines() if LEARNER_FILE in line
            or line.startswith(" ") and not line.lstrip().startswith("In file")]
    return "\n".join(keep[:40]) if any(LEARNER_FILE in line for line in keep) else err[-4000:]


def build(code: str | None = None, sanitizer: str = "thread") -> Path:
    """The exercise program with ``code`` as phase 3 (default: ``PHASE3``, else the package's),
    built with ``sanitizer`` (cached)."""
    if code is None:
        code = PHASE3 if PHASE3 is not None else package_phase3()
    return _build(code, MAIN, _flags(sanitizer), SANITIZERS[sanitizer], sanitizer, "")


def _build(code: str, main: Path, flags: list[str], link_flags: list[str], folder: str,
           suffix: str) -> Path:
    """Compile the runtime, ``main`` and the exercise's translation unit with ``flags`` (each
    object cached by a digest of what it is made of), link them with ``link_flags`` into
    ``extensions_root()/kernel_exercise/<folder>/exercise-<digest><suffix>``."""
    headers = b"".join(p.read_bytes() for p in [RUNTIME_DIR / "cuda_on_cpu.h", *CUDA_HEADERS])
    root = extensions_root() / "kernel_exercise" / folder
    root.mkdir(parents=True, exist_ok=True)
    parts = [(RUNTIME_DIR / "cuda_on_cpu.cpp", None), (main, None), (None, exercise_source(code))]
    jobs = []
    for source, body in parts:
        made_of = body.encode() if body is not None else source.read_bytes()
        name = source.name if source else "exercise"
        obj = root / f"{name}-{_digest(flags, headers, made_of)}.o"
        jobs.append((obj, _compile(source, body, obj, flags)))
    for obj, process in jobs:
        err = _finish(process, obj)
        if err is not None:
            raise CompileError(learner_messages(err))
    target = root / f"exercise-{_digest(*(obj.name for obj, _ in jobs))}{suffix}"
    if not target.exists():
        link = subprocess.run(["g++", *link_flags, "-pthread", *(str(obj) for obj, _ in jobs),
                               "-o", f"{target}.tmp"], capture_output=True, text=True)
        if link.returncode:
            raise CompileError(link.stderr[-4000:])
        Path(f"{target}.tmp").rename(target)
    return target


@dataclass
class Case:
    """One random case: N(0, 1) query and caches, shuffled blocks, a few context lengths."""

    query: torch.Tensor  # (num_seqs, num_heads, 64)
    key_cache: torch.Tensor  # (num_blocks, num_kv_heads, 16, 16, 4)
    value_cache: torch.Tensor  # (num_blocks, num_kv_heads, 64, 16)
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) int32
    context_lens: torch.Tensor  # (num_seqs,) int32
    scale: float

    def reference(self) -> torch.Tensor:
        return reference.paged_attention(self.query, self.key_cache, self.value_cache,
                                         self.block_tables, self.context_lens, self.scale)

    def logits(self, seq: int, head: int) -> torch.Tensor:
        """(context_len,) the scaled q.k of one sequence and head, from the torch reference."""
        num_kv_heads = self.key_cache.shape[1]
        kv_head = head // (self.query.shape[1] // num_kv_heads)
        n = int(self.context_lens[seq])
        blocks = self.block_tables[seq, :-(-n // BLOCK_SIZE)].long()
        keys = self.key_cache[blocks, kv_head].permute(0, 2, 1, 3).reshape(-1, HEAD_SIZE)[:n]
        return (keys.double() @ self.query[seq, head].double()) * self.scale  # (n,)


def random_case(seed: int, lens: tuple[int, ...] = (1, 16, 37, 150), num_heads: int = 2,
                num_kv_heads: int = 1) -> Case:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks_per_seq) + 1
    key_cache = torch.randn(num_blocks, num_kv_heads, HEAD_SIZE // X, BLOCK_SIZE, X, generator=gen)
    value_cache = torch.randn(num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE, generator=gen)
    query = torch.randn(len(lens), num_heads, HEAD_SIZE, generator=gen)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    width, tables, used = max(blocks_per_seq), [], 0
    for n in blocks_per_seq:
        row = pool[used:used + n]
        used += n
        tables.append(row + [row[0]] * (width - n))
    return Case(query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32), HEAD_SIZE ** -0.5)


@dataclass
class Run:
    out: torch.Tensor | None  # (num_seqs, num_heads, 64), None if the program did not finish
    thread_max: torch.Tensor | None  # (num_seqs, num_heads, 128): each thread's max_logit
    thread_sum: torch.Tensor | None  # (num_seqs, num_heads, 128): each thread's exp_sum
    report: str  # the sanitizer's report ('' when it had nothing to say)
    returncode: int
    shuffles: list[dict] | None = None  # the traced warp's shuffles (cuda_on_cpu.shuffle_steps)


def run(program: Path, case: Case, trace: tuple[int, int, int] | None = None,
        timeout: float = 120) -> Run:
    """Run ``case``; ``trace`` = (head, sequence, warp) records that warp's shuffles."""
    num_seqs, num_heads, _ = case.query.shape
    num_blocks, num_kv_heads = case.key_cache.shape[:2]
    header = np.array([num_seqs, num_heads, num_kv_heads, num_blocks, case.block_tables.shape[1],
                       int(case.context_lens.max())], dtype=np.int32)
    with tempfile.TemporaryDirectory(prefix="minipaged_exercise_") as folder:
        inputs, outputs = Path(folder) / "in.bin", Path(folder) / "out.bin"
        with open(inputs, "wb") as f:
            for part in [header, np.array([case.scale], dtype=np.float32),
                         case.context_lens.numpy(), case.block_tables.numpy(),
                         case.query.numpy(), case.key_cache.numpy(), case.value_cache.numpy()]:
                f.write(np.ascontiguousarray(part).tobytes())
        env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66",
               "ASAN_OPTIONS": "halt_on_error=1 detect_leaks=0"}
        extra = [str(v) for v in trace] if trace else []
        done = subprocess.run([str(program), str(inputs), str(outputs), *extra], capture_output=True,
                              text=True, timeout=timeout, env=env)
        report = done.stderr if "Sanitizer" in done.stderr else ""
        if done.returncode or not outputs.exists():
            return Run(None, None, None, report or done.stderr[-4000:], done.returncode)
        data = np.fromfile(outputs, dtype=np.float32)
    size = num_seqs * num_heads
    out = torch.from_numpy(data[1:1 + size * HEAD_SIZE].copy()).view(num_seqs, num_heads, -1)
    rest = data[1 + size * HEAD_SIZE:]
    per_thread = torch.from_numpy(rest[:2 * size * NUM_THREADS].copy()).view(
        2, num_seqs, num_heads, NUM_THREADS)
    shuffles = None
    if trace:
        records = rest[2 * size * NUM_THREADS + 1:].view(np.int32).reshape(-1, 4).tolist()
        shuffles = shuffle_steps(records)
    return Run(out, per_thread[0], per_thread[1], report, done.returncode, shuffles)


def report_lines(report: str) -> list[int]:
    """The learner's lines a sanitizer report names, in order, each once."""
    seen: list[int] = []
    for line in re.findall(re.escape(LEARNER_FILE) + r":(\d+)", report):
        if int(line) not in seen:
            seen.append(int(line))
    return seen


# ----------------------------------------------------------------------------------------------
# The exercise build as a library: the learner's phase 3 in the engine (lesson 16's capstone)
# ----------------------------------------------------------------------------------------------
def build_library(code: str | None = None) -> Path:
    """The exercise build with ``code`` as phase 3 (default as in ``build``) as a shared
    library, optimised and without a sanitizer, for ``ExerciseKernel`` (cached by digest)."""
    if code is None:
        code = PHASE3 if PHASE3 is not None else package_phase3()
    flags = [*FLAGS, "-O2", "-fPIC", f"-I{RUNTIME_DIR / 'include'}", f"-I{CSRC}"]
    return _build(code, LIBRARY_MAIN, flags, ["-shared"], "library", ".so")


class ExerciseKernel:
    """The V1 kernel with a learner's phase 3, built for the CPU, as the engine's decode
    attention: ``paged_attention`` takes what ``minipaged.kernels.ops.paged_attention`` takes.

    Only the exercise build's one shape runs on it (float32, head size 64, block size 16); other
    calls raise ``ValueError`` naming what differs. ``calls`` counts the calls it served.
    """

    def __init__(self, code: str | None = None) -> None:
        self.library = _load_library(str(build_library(code)))
        self.calls = 0

    def paged_attention(self, query, key_cache, value_cache, block_tables, context_lens, scale,
                        max_context_len=None, kv_scales=None, window=None) -> torch.Tensor:
        num_seqs, num_heads, head_size = query.shape
        num_blocks, num_kv_heads = key_cache.shape[:2]
        problems = [f"{what} is {got}, the exercise build has {want}" for what, got, want in [
            ("the dtype", query.dtype, torch.float32), ("the cache's dtype", key_cache.dtype,
                                                        torch.float32),
            ("the head size", head_size, HEAD_SIZE),
            ("the block size", key_cache.shape[3], BLOCK_SIZE)] if got != want]
        if kv_scales is not None or window is not None:
            problems.append("an 8-bit cache or a sliding window: the exercise build reads "
                            "neither")
        if problems:
            raise ValueError("your phase 3's kernel cannot run this call: " + "; ".join(problems))
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        # NOTE: the kernel reads raw pointers: what would read past a buffer is refused here
        caches = (num_blocks, num_kv_heads, HEAD_SIZE // X, BLOCK_SIZE, X), (
            num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE)
        if num_heads % num_kv_heads or (tuple(key_cache.shape),
                                        tuple(value_cache.shape)) != caches:
            problems.append(f"query heads {num_heads}, key cache {tuple(key_cache.shape)} and "
                            f"value cache {tuple(value_cache.shape)} do not fit together")
        if tables.dim() != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
            problems.append(f"block_tables {tuple(tables.shape)} and context_lens "
                            f"{tuple(lens.shape)} must have a row for each of {num_seqs} "
                            f"sequences")
        elif num_seqs and (int(lens.min()) < 1
                           or int(lens.max()) > tables.shape[1] * BLOCK_SIZE
                           or int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
            problems.append(f"context_lens {lens.tolist()} must be 1 to {tables.shape[1]} "
                            f"blocks of {BLOCK_SIZE}, block numbers 0 to {num_blocks - 1}")
        if problems:
            raise ValueError("your phase 3's kernel cannot run this call: " + "; ".join(problems))
        tensors = [t.contiguous() for t in (query, key_cache, value_cache)]
        out = torch.empty_like(tensors[0])
        per_thread = torch.empty(2, num_seqs * num_heads * NUM_THREADS)
        longest = max(int(lens.max()) if num_seqs else 0, int(max_context_len or 0))
        pointer = lambda t: ctypes.c_void_p(t.data_ptr())
        status = self.library.exercise_paged_attention_v1(
            pointer(out), *map(pointer, tensors), pointer(tables), pointer(lens), num_seqs,
            num_heads, num_kv_heads, tables.shape[1], longest, ctypes.c_float(scale),
            pointer(per_thread[0]), pointer(per_thread[1]))
        if status:
            raise RuntimeError("the kernel with your phase 3 failed: "
                               + self.library.exercise_last_error().decode())
        self.calls += 1
        return out


@functools.lru_cache(maxsize=None)
def _load_library(path: str):
    library = ctypes.CDLL(path)
    library.exercise_paged_attention_v1.restype = ctypes.c_int
    library.exercise_paged_attention_v1.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 5 + [
        ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    library.exercise_last_error.restype = ctypes.c_char_p
    return library
