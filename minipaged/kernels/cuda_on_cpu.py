"""The real CUDA kernels of ``csrc/``, compiled for the CPU and run lane by lane (lessons 05, 06).

``load()`` compiles the ``.cu`` files of ``CU_SOURCES`` (``csrc/paged_attention.cu`` and the
others) and ``csrc/torch_bindings.cpp`` with the host C++ compiler (``torch.utils.cpp_extension``, cached on
disk) against ``csrc/cuda_on_cpu/cuda_on_cpu.h``, a small CUDA runtime in which every CUDA
thread is a host thread: ``__syncthreads`` is a real barrier of the block, ``__shfl_xor_sync`` a
real exchange among the 32 lanes of a warp, shared memory is sized as on an sm_90 GPU, fp16/bf16
round as on the GPU. It returns a ``CudaKernels`` object (see ``minipaged.kernels.cuda_kernels``)
whose methods take CPU tensors::

    kernels = cuda_on_cpu.load()
    out = kernels.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                  scale)

Three builds of the same sources (``VARIANTS``): ``load()`` is the kernel as a GPU runs it;
``load("traced")`` defines ``MINIPAGED_TRACE``, so that the kernel's ``MP_TRACE`` calls record
its loops (``minipaged.lab.kernel_trace.run_traced`` reads them); ``load("shared_load")``
also defines ``MINIPAGED_SHARED_GROUP_LOAD``, vLLM's way of loading keys (lesson 05).

This is for tests, sanitizers and the lessons, not for speed: a decode step of a small model takes
seconds. The build is a ``minipaged.kernels.build.JitBuild`` like the CPU and CUDA ops, but it
raises when it fails (there is nothing to fall back to when the point is to run these kernels).
Here every tensor is on the host, so the binding also checks the contents of ``context_lens``,
``block_tables`` and ``slot_mapping``; ``kernels.module.set_host_checks(False)`` skips those
checks, as a GPU build must, to show what the kernels themselves do with such input. Blocks run
one at a time, in blockIdx order unless ``kernels.module.set_block_order`` asks for them reversed
or shuffled (a GPU promises no order; V2's fused reduce is tested in all three).

Two bits of CUDA syntax that the preprocessor cannot handle are rewritten on a temporary copy of
each ``.cu`` file, line for line, so that compiler messages and sanitizer reports name the real
file and line (``rewrite_cuda_source``). The same rewrite builds the sanitizer programs
(``build_sanitizer_program``), where one ``__syncthreads`` can be dropped on purpose to show that
ThreadSanitizer catches the data race it leaves.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
from pathlib import Path

from minipaged.cache_paths import extensions_root
from minipaged.kernels.build import CSRC, CUDA_HEADERS, CUDA_PROBE, JitBuild, compile_extension
from minipaged.kernels.cuda_kernels import CudaKernels

RUNTIME_DIR = CSRC / "cuda_on_cpu"
CU_SOURCES = ("paged_attention.cu", "cache_kernels.cu", "layer_kernels.cu", "gguf_matmul.cu")
RUNTIME_SOURCES = ("cuda_on_cpu.cpp",)
# MINIPAGED_ALL_PARTS: every instance of paged_attention.cu from that one file (the GPU build
# splits them over three files: see "three translation units" there)
FLAGS = ["-std=c++17", "-fno-strict-aliasing", "-Wno-unknown-pragmas", "-pthread",
         "-DMINIPAGED_ALL_PARTS"]

_LAUNCH = re.compile(r"<<<(.*?)>>>", re.S)
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w:]*)\s+(\w+)\s*\[\s*\]\s*;")


# paged_attention.cu's other files (one kernel family each): pasted into it before the rewrite,
# so that their launches and shared arrays are rewritten too
_PART_INCLUDE = re.compile(r'^#include "(paged_attention_\w+\.cuh)"')


def inline_kernel_parts(text: str, path: str) -> str:
    """``text`` with each ``#include "paged_attention_<part>.cuh"`` line replaced by that file's
    text (itself inlined), between ``#line`` directives: messages still name the real file and
    line."""
    lines = text.split("\n")
    for i in reversed(range(len(lines))):
        match = _PART_INCLUDE.match(lines[i])
        if match:
            part = Path(path).parent / match.group(1)
            lines[i:i + 1] = [f'#line 1 "{part}"', inline_kernel_parts(part.read_text(), str(part)),
                              f'#line {i + 2} "{path}"']
    return "\n".join(lines)


def rewrite_cuda_source(text: str, path: str, drop_barrier: str | None = None) -> str:
    """CUDA source -> host C++ for ``cuda_on_cpu.h``, with the same line numbers.

    Args:
        text: the ``.cu`` file's text.
        path: its path, for the ``#line`` directive.
        drop_barrier: if given, the ``__syncthreads();`` on the first line containing this text
            is compiled out (the removed-barrier demonstration of the sanitizer tests).

    ``kernel<<<grid, block, smem, stream>>>(args)`` becomes
    ``kernel % ::cuda_on_cpu::LaunchConfig(grid, block, smem, stream)(args)`` and
    ``extern __shared__ T name[];`` becomes ``T* const name = ::cuda_on_cpu::dynamic_shared<T>();``.
    The ``paged_attention_<part>.cuh`` files it includes are pasted in first (``inline_kernel_parts``).
    """
    text = inline_kernel_parts(text, path)
    text = _LAUNCH.sub(lambda m: f" % ::cuda_on_cpu::LaunchConfig({m.group(1)})", text)
    text = _EXTERN_SHARED.sub(
        lambda m: f"{m.group(1)}* const {m.group(2)} = ::cuda_on_cpu::dynamic_shared<{m.group(1)}>();",
        text)
    if drop_barrier is not None:
        lines = text.split("\n")
        hits = [i for i, line in enumerate(lines) if drop_barrier in line and "__syncthreads();" in line]
        if not hits:
            raise ValueError(f"no line with __syncthreads(); contains {drop_barrier!r}")
        lines[hits[0]] = lines[hits[0]].replace("__syncthreads();", "/* barrier dropped */;", 1)
        text = "\n".join(lines)
    return f'#line 1 "{path}"\n{text}'


def rewritten_sources(drop_barrier: str | None = None) -> dict[str, str]:
    """The ``.cu`` files rewritten for the host compiler: ``{"<name>.cpp": text}``."""
    return {f"{name}.cpp": rewrite_cuda_source(
                (CSRC / name).read_text(), str(CSRC / name),
                drop_barrier if name == "paged_attention.cu" else None)
            for name in CU_SOURCES}


def write_rewritten_sources(out_dir: Path, drop_barrier: str | None = None) -> list[Path]:
    """The rewritten ``.cu`` files as ``out_dir/<name>.cpp``; a file is rewritten only when its
    text changes, so that the objects compiled from it stay valid."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for file, text in rewritten_sources(drop_barrier).items():
        target = out_dir / file
        if not target.exists() or target.read_text() != text:
            # (whole or not at all: another process may be compiling the same file right now)
            part = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            part.write_text(text)
            os.replace(part, target)
        written.append(target)
    return written


# variant -> (the build's tag, the first part of its folder's name; extension name; extra macros)
VARIANTS = {
    "plain": ("cuda_on_cpu", "minipaged_cuda_on_cpu", []),
    "traced": ("cuda_on_cpu_traced", "minipaged_cuda_on_cpu_traced", ["-DMINIPAGED_TRACE"]),
    "shared_load": ("cuda_on_cpu_shared_load", "minipaged_cuda_on_cpu_shared_load",
                    ["-DMINIPAGED_TRACE", "-DMINIPAGED_SHARED_GROUP_LOAD"]),
}


def _make(job: JitBuild, variant: str) -> CudaKernels:
    tag, name, macros = VARIANTS[variant]
    os.environ.setdefault("MAX_JOBS", "2")
    module = compile_extension(
        job, name=name, tag=tag, generated=rewritten_sources(), probe=CUDA_PROBE,
        sources=[CSRC / "torch_bindings.cpp", *(RUNTIME_DIR / s for s in RUNTIME_SOURCES)],
        depends=[*CUDA_HEADERS, RUNTIME_DIR / "cuda_on_cpu.h",
                 *sorted(p for p in (RUNTIME_DIR / "include").rglob("*") if p.is_file())],
        extra_include_paths=[str(RUNTIME_DIR / "include"), str(CSRC)],
        extra_cflags=["-O2", "-DMINIPAGED_CUDA_ON_CPU", *macros, *FLAGS[1:]],
        extra_ldflags=["-pthread"])
    return CudaKernels(module)


# NOTE: strict: a failed build raises, since there is nothing to fall back to when the point is
# to run these very kernels; and no switch turns it off.
BUILDS = {variant: JitBuild(f"the CUDA kernels for the CPU ({variant})", "a few minutes",
                            functools.partial(_make, variant=variant), strict=True)
          for variant in VARIANTS}
BUILD = BUILDS["plain"]


def load(variant: str = "plain") -> CudaKernels:
    """The CUDA kernels built for the CPU (once per process, cached on disk): ``variant`` is
    "plain" (as on a GPU), "traced" (MP_TRACE records) or "shared_load" (traced, with vLLM's
    key load)."""
    if variant not in BUILDS:
        raise ValueError(f"variant must be one of {sorted(BUILDS)}, not {variant!r}")
    return BUILDS[variant].load()


# ----------------------------------------------------------------------------------------------
# One warp's shuffles, recorded while the real kernel runs (lesson 06)
# ----------------------------------------------------------------------------------------------
def trace_shuffles(kernels, run, block=(0, 0, 0), warp: int = 0):
    """Run ``run()`` (a call of ``kernels``) with the shuffles of one warp recorded.

    ``block`` is the CUDA block's ``blockIdx`` (x, y, z): for ``paged_attention``, (head,
    sequence, partition). Returns ``(run(), steps)``: one dict per shuffle the warp's 32 lanes
    made together, in program order, with ``src_lanes`` (the lane each lane read), ``sent`` and
    ``received`` (the 32 lanes' float32 values) and ``mask`` (the XOR mask when lane l read lane
    l ^ mask, None for a broadcast such as ``__shfl_sync(v, 0)``).
    """
    module = kernels.module
    module.trace_warp(*block, warp)
    try:
        result = run()
    finally:
        records = module.take_warp_trace()
        module.trace_warp(0, 0, 0, -1)
    return result, shuffle_steps(records)


def shuffle_steps(records) -> list[dict]:
    """One warp's shuffle records ``(lane, source lane, sent bits, received bits)``, in the
    order the runtime made them, as ``trace_shuffles``'s steps."""
    import numpy as np

    per_lane: dict[int, list] = {}
    for lane, src, sent, received in records:
        per_lane.setdefault(lane, []).append((src, sent, received))

    def floats(bits) -> np.ndarray:
        return np.array(bits, dtype=np.int64).astype(np.uint32).view(np.float32)

    steps = []
    for i in range(min((len(v) for v in per_lane.values()), default=0)):
        src = [per_lane[lane][i][0] for lane in sorted(per_lane)]
        xor = {lane ^ s for lane, s in enumerate(src)}
        steps.append({"src_lanes": src, "mask": xor.pop() if len(xor) == 1 else None,
                      "sent": floats([per_lane[lane][i][1] for lane in sorted(per_lane)]),
                      "received": floats([per_lane[lane][i][2] for lane in sorted(per_lane)])})
    return steps


def butterfly_runs(steps: list[dict], op: str, first_mask: int) -> list[list[dict]]:
    """The butterflies among ``steps`` (from ``trace_shuffles``) that start at ``first_mask``
    and halve it each step, as records ``visualizer.render_butterfly`` draws (the combined value
    after each step is ``op``, "max" or "sum", of the value sent and the value received)."""
    import numpy as np

    combine = np.maximum if op == "max" else np.add
    runs, i = [], 0
    while i < len(steps):
        if steps[i]["mask"] != first_mask:
            i += 1
            continue
        run, mask = [], first_mask
        while i < len(steps) and mask >= 1 and steps[i]["mask"] == mask:
            step = steps[i]
            run.append({"phase": op, "step": len(run), "mask": mask,
                        "pairs": [[lane, src] for lane, src in enumerate(step["src_lanes"])],
                        "values_before": [float(v) for v in step["sent"]],
                        "values_after": [float(v) for v in
                                         combine(step["sent"], step["received"])]})
            i, mask = i + 1, mask // 2
        runs.append(run)
    return runs


# ----------------------------------------------------------------------------------------------
# Sanitizer programs: the kernels plus csrc/cuda_on_cpu/sanitize_main.cpp, no Python, no torch
# ----------------------------------------------------------------------------------------------
SANITIZERS = {"thread": ["-fsanitize=thread"], "address": ["-fsanitize=address",
                                                           "-fno-omit-frame-pointer"]}


def build_sanitizer_program(sanitizer: str, drop_barrier: str | None = None,
                            compiler: str = "g++") -> Path:
    """Build (or reuse) the sanitizer test program; returns the executable's path.

    The program (``csrc/cuda_on_cpu/sanitize_main.cpp``) runs small cases of every kernel; built with
    ``-fsanitize=thread`` or ``-fsanitize=address``. Objects are cached by a hash of their
    (rewritten) source, the headers and the flags, so a second variant (``drop_barrier``)
    recompiles only paged_attention.cu.
    """
    flags = [*FLAGS, "-O1", "-g", "-DMINIPAGED_FEW_INSTANCES", *SANITIZERS[sanitizer],
             f"-I{RUNTIME_DIR / 'include'}", f"-I{CSRC}"]
    headers = b"".join(p.read_bytes() for p in [RUNTIME_DIR / "cuda_on_cpu.h", *CUDA_HEADERS])
    root = extensions_root() / "sanitize" / sanitizer
    rewritten = write_rewritten_sources(root / f"src-{_digest(drop_barrier or '')}", drop_barrier)
    sources = [*rewritten, *(RUNTIME_DIR / s for s in RUNTIME_SOURCES), RUNTIME_DIR / "sanitize_main.cpp"]
    objects, jobs = [], []
    for source in sources:
        obj = root / f"{source.name}-{_digest(flags, compiler, headers, source.read_bytes())}.o"
        objects.append(obj)
        if not obj.exists():
            jobs.append((obj, subprocess.Popen(
                [compiler, *flags, "-x", "c++", "-c", str(source), "-o", _part(obj)],
                stderr=subprocess.PIPE, text=True)))
        if len(jobs) >= int(os.environ.get("MAX_JOBS", "2")):
            _wait(*jobs.pop(0))
    for job in jobs:
        _wait(*job)
    program = root / f"sanitize_main-{_digest(*(o.name for o in objects))}"
    if not program.exists():
        _wait(program, subprocess.Popen(
            [compiler, *SANITIZERS[sanitizer], "-pthread", *map(str, objects), "-o",
             _part(program)], stderr=subprocess.PIPE, text=True))
    return program


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
    return h.hexdigest()[:16]


def _part(target: Path) -> str:
    """Where this process writes ``target`` before renaming it: its own file, so that two
    processes building the same object (two test workers) never rename each other's."""
    return f"{target}.{os.getpid()}.tmp"


def _wait(target: Path, process: subprocess.Popen) -> None:
    """Wait for a compile or link of ``target`` (written as ``_part(target)``, renamed when
    done; the same bytes whichever process renames last)."""
    _, err = process.communicate()
    if process.returncode:
        raise RuntimeError(f"building the sanitizer program failed:\n{err}")
    os.replace(_part(target), target)
