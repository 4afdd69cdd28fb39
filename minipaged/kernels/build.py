"""Compiling the C++ and CUDA ops just in time: one helper for every build (lesson 05).

Three builds use it: the C++ CPU op (``csrc/cpu/attention.cpp``, ``CPU_OP`` below), the CUDA
kernels (``csrc/*.cu`` + ``csrc/torch_bindings.cpp``, ``CUDA_OP`` below) and the same ``.cu``
files compiled for the CPU (``minipaged.kernels.cuda_on_cpu``). Each is a ``JitBuild``:

- built at most once per process, under a lock, so two threads never build at once; a failed
  build is tried once too (the CPU and CUDA ops then warn once and ``load()`` returns None, so
  that ``minipaged.kernels.ops`` runs the torch reference);
- compiled by ``torch.utils.cpp_extension`` into ``<cache root>/torch_ext`` (``~/.cache/minipaged``
  or ``$MINIPAGED_CACHE``, see ``minipaged.cache_paths``), one folder per build named by a digest
  of everything it is made from, behind a lock the operating system releases if its holder dies
  (``build_cache.py``): a killed build never hangs the next process, and two checkouts never
  rebuild each other's library;
- linked with the shared libstdc++ named explicitly, and checked once after each build
  (``library_check.py``): a library carrying a private copy of libstdc++, or whose error path
  cannot raise, is not used;
- announced on stderr when a compile actually runs ("minipaged: building the C++ CPU attention
  op (first use only, 1-2 min on 2 cores)..."), silent when the cached library is loaded;
- startable in the background: ``start_background_build(device)`` compiles the op of a device
  in a daemon thread while the model's weights load, and ``load()`` then waits for that build
  instead of starting a second one.

The switches, one convention for both: ``MINIPAGED_CPU_OP=0`` turns the C++ CPU op off,
``MINIPAGED_CUDA_OP=0`` the CUDA kernels; unset (or any other value) means on.

``python -c "from minipaged.kernels import build; build.prebuild()"`` builds the CPU op now (the
set-up step of the Makefile does this so that the first request does not wait for it).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

from minipaged.kernels.build_cache import (build_folder, build_key, build_lock, copy_sources,
                                           prune_siblings, toolchain_identity)
from minipaged.kernels.build_progress import finish_before_exit
from minipaged.kernels.build_thread import before_a_build_thread, lower_this_threads_priority
from minipaged.kernels.cpu_kernels import CpuKernels
from minipaged.kernels.cuda_kernels import CudaKernels
from minipaged.kernels.library_check import verify

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def switched_on(switch: str) -> bool:
    """False when the environment variable ``switch`` is "0" (the op is turned off)."""
    return os.environ.get(switch, "1") != "0"


def make_ninja_findable() -> None:
    """torch's JIT builds need ninja; the pip package 'ninja' ships one outside PATH."""
    from torch.utils import cpp_extension

    if cpp_extension.is_ninja_available():
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return  # cpp_extension.load raises a clear error of its own
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


class JitBuild:
    """One compiled op, built on first use (or in the background) and kept for the process.

    Args:
        what: what is built, for messages ("the C++ CPU attention op").
        duration: how long a first build takes, for the progress line ("~30 s").
        make: ``make(job)`` compiles (``compile_extension``) and returns the op's wrapper, or
            None where it cannot run here (no GPU); it raises when the build fails.
        switch: the environment variable that turns the op off with "0", or None.
        strict: raise a failed build's error from ``load()`` instead of warning and returning
            None (for the CUDA-on-CPU build: there is nothing to fall back to).
    """

    def __init__(self, what: str, duration: str, make: Callable[[JitBuild], object],
                 switch: str | None = None, strict: bool = False):
        self.what, self.duration, self.make = what, duration, make
        self.switch, self.strict = switch, strict
        self._lock = threading.Lock()  # held for the whole build: a second caller waits
        self._done = False
        self._result = None
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None
        self.compiling = False  # a compile (not the load of a cached library) is under way
        # set once the background build knows whether it compiles or loads (``compiling``)
        self._decided = threading.Event()
        self._waited = False  # whether an op was asked for while the background build compiled
        # where a compile writes its objects, and how many it writes (``compile_extension``):
        # what the line at exit counts while the process waits for a background build
        self.folder: Path | None = None
        self.num_objects = 0
        self.started = 0.0

    def enabled(self) -> bool:
        """Whether the switch leaves this op on (checked at every call, so tests can flip it)."""
        return self.switch is None or switched_on(self.switch)

    def built(self) -> bool:
        """Whether the build has been tried (successfully or not) in this process."""
        return self._done

    def load(self):
        """The op's wrapper, built now or by the background build (waited for); None when the
        op is switched off, cannot run here, or (not strict) its build failed."""
        if not self.enabled():
            return None
        if not self._done:
            with self._lock:
                if not self._done:
                    self._try_build()
                    self._done = True
        if self._error is not None:
            raise self._error
        return self._result

    def ready(self):
        """The op's wrapper where this process has built or loaded it already, else None (off,
        not built yet, compiling, failed, or nothing to run here). Never starts or waits for
        a build: for callers that use the op only where it is there (``cpu_matmul``)."""
        if not self.enabled() or not self._done or self._error is not None:
            return None
        return self._result

    def load_unless_compiling(self):
        """``load()``, except while the background build is compiling: then None at once (the
        torch reference runs meanwhile), with a line when that starts and when the op is ready.

        NOTE: only a compile is not waited for. Loading a library built before takes a moment
        and is waited for, so that a process's results never depend on the build's timing."""
        if not self._done and self._thread is not None:
            self._decided.wait()  # (the sources' hash before a compile: a moment)
        if not self._done and self.compiling and self._thread is not None:
            if not self._waited:
                self._waited = True
                print(f"minipaged: {self.what} is still compiling; the torch reference runs "
                      f"until it is ready", file=sys.stderr, flush=True)
            return None
        op = self.load()
        if self._waited and op is not None:
            self._waited = False
            print(f"minipaged: {self.what} is ready: it runs from this step on",
                  file=sys.stderr, flush=True)
        return op

    def start_in_background(self) -> None:
        """Start ``load()`` in a daemon thread unless the op is off, built or being built."""
        with _start_lock:
            if not self.enabled() or self._done or self._thread is not None:
                return
            before_a_build_thread()
            self._thread = threading.Thread(target=self._load_quietly, daemon=True,
                                            name=f"minipaged build: {self.what}")
            self._thread.start()
        # NOTE: a process that ends normally waits for its build rather than throw the work away
        # (a killed one leaves no harm behind: build_cache.build_lock cleans up after it).
        atexit.register(finish_before_exit, self)

    def _load_quietly(self) -> None:
        lower_this_threads_priority()
        try:
            self.load()
        except Exception:  # noqa: BLE001 - a strict build's error is raised again by load()
            pass
        finally:
            self._decided.set()  # (a build that failed before it knew)

    def _try_build(self) -> None:
        try:
            self._result = self.make(self)
        except Exception as exc:  # noqa: BLE001 - any build failure means "no compiled op"
            if self.strict:
                self._error = exc
                return
            hint = f" Set {self.switch}=0 to skip the build." if self.switch else ""
            what = (f"minipaged: {exc}" if isinstance(exc, LibraryRefused) else
                    f"minipaged: building {self.what} failed\n{type(exc).__name__}: {exc}")
            warnings.warn(f"{what}\nThe plain torch reference runs instead (slower).{hint}",
                          RuntimeWarning, stacklevel=4)


_start_lock = threading.Lock()


class LibraryRefused(RuntimeError):
    """A library was built but fails ``library_check.verify``: it must not be used."""


# NOTE: the shared libstdc++ named on the link line, before the libraries g++ adds by itself:
# every C++ runtime symbol then resolves to it, and no private copy of libstdc++ can be linked
# into the library (by -static-libstdc++ from a flag or a toolchain default), which is what made
# every error message with a number crash on a GPU machine (see library_check.py).
SHARED_CXX_RUNTIME = "-l:libstdc++.so.6"


def compile_extension(job: JitBuild, name: str, tag: str, sources: list[Path],
                      depends: list[Path] = (), generated: dict[str, str] | None = None,
                      probe: tuple[str, str] | None = None, **load_kwargs):
    """``torch.utils.cpp_extension.load`` into the build's own folder, under its lock.

    The folder is named by a digest of everything the library is made from
    (``build_cache.build_key``), and the files are compiled from a copy inside it, so that
    builds that differ never share a folder and identical builds from two checkouts share one.

    Args:
        job: the build, for messages.
        name: the extension's module name (also its library's file name).
        tag: a readable prefix for the folder ("cpu-AVX2", "cuda13.0-sm90").
        sources: the files compiled (under ``csrc/`` or anywhere).
        depends: headers they include: copied too and part of the digest. An include path that
            points into ``csrc/`` is pointed at the copy, so a header not listed here is not found
            (the compiler says so at once, instead of a stale build).
        generated: more sources as ``{file name: text}`` (the rewritten ``.cu`` files).
        probe: ``(call, expect)`` for ``library_check.verify``: an error path that must raise.
        load_kwargs: passed on (extra_cflags, extra_cuda_cflags, extra_ldflags,
            extra_include_paths, ...).
    """
    make_ninja_findable()
    files = {_copy_name(path): Path(path).read_bytes() for path in [*sources, *depends]}
    files.update({f"src/{file}": text.encode() for file, text in (generated or {}).items()})
    include_paths = [_copy_name(p) if _in_csrc(p) else str(p)
                     for p in load_kwargs.pop("extra_include_paths", [])]
    load_kwargs["extra_ldflags"] = [SHARED_CXX_RUNTIME, *load_kwargs.get("extra_ldflags", [])]
    key = build_key(name, sorted(files.items()), include_paths, sorted(load_kwargs.items()),
                    toolchain_identity())
    folder = build_folder(tag, key)
    job.folder, job.num_objects = folder, len(sources) + len(generated or {})
    job.started = time.monotonic()
    job.compiling = not (folder / f"{name}.so").exists()  # (or another process compiles it)
    job._decided.set()
    try:
        return _compile_in(job, folder, name, sources, files, include_paths, generated, probe,
                           load_kwargs)
    finally:
        job.compiling = False


def _compile_in(job: JitBuild, folder: Path, name: str, sources: list[Path], files: dict,
                include_paths: list[str], generated: dict[str, str] | None,
                probe: tuple[str, str] | None, load_kwargs: dict):
    """``compile_extension``'s build in ``folder``, under its lock."""
    from torch.utils import cpp_extension

    with build_lock(folder, job.what):
        copy_sources(files, folder)
        library = folder / f"{name}.so"
        announce = not library.exists()
        if announce:
            print(f"minipaged: building {job.what} (first use only, {job.duration})...",
                  file=sys.stderr, flush=True)
        start = time.perf_counter()
        module = cpp_extension.load(
            name=name, build_directory=str(folder),
            sources=[str(folder / _copy_name(s)) for s in sources]
            + [str(folder / "src" / file) for file in (generated or {})],
            extra_include_paths=[str(folder / p) if not os.path.isabs(p) else p
                                 for p in include_paths],
            verbose=os.environ.get("MINIPAGED_VERBOSE_BUILD", "") not in ("", "0"),
            **load_kwargs)
        if announce:
            print(f"minipaged: {job.what} built in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
        if probe is not None:
            problem = verify(Path(module.__file__), module.__name__, *probe)
            if problem is not None:
                raise LibraryRefused(f"{job.what} was built ({module.__file__}) but is not "
                                     f"used: {problem}")
    os.utime(folder)  # the folder's time stamp says when it was last used (pruning keeps those)
    prune_siblings(folder)
    return module


def _in_csrc(path) -> bool:
    return Path(path).resolve().is_relative_to(CSRC)


def _copy_name(path) -> str:
    """Where a file is copied inside a build folder: ``csrc/<path in csrc>`` or ``src/<name>``."""
    path = Path(path).resolve()
    return f"csrc/{path.relative_to(CSRC)}" if path.is_relative_to(CSRC) else f"src/{path.name}"


# ----------------------------------------------------------------------------------------------
# The two ops the engine uses
# ----------------------------------------------------------------------------------------------
# Compiler flags per vector instruction set torch reports for this CPU.
_ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def cpu_capability() -> str:
    """The vector instructions torch found on this CPU: 'AVX512', 'AVX2', 'DEFAULT', ..."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - very old torch
        return "DEFAULT"


def _make_cpu_op(job: JitBuild) -> CpuKernels:
    capability = cpu_capability()
    # NOTE: -fopenmp makes at::parallel_for (a header template) run on torch's thread pool;
    # without it the loops would run on one thread.
    module = compile_extension(
        job, name=f"minipaged_cpu_{capability.lower()}", tag=f"cpu-{capability}",
        sources=[CSRC / "cpu" / n for n in ("attention.cpp", "attention_int8.cpp",
                                           "attention_fp8.cpp", "linear.cpp", "gguf_linear.cpp",
                                           "gguf_kquants.cpp", "layers.cpp")],
        depends=[CSRC / "cpu" / "vec8.h", CSRC / "cpu" / "linear_tile.h"],
        probe=CPU_OP_PROBE,
        extra_cflags=["-O3", "-fopenmp", *_ARCH_FLAGS.get(capability, [])],
        extra_ldflags=["-fopenmp"])
    return CpuKernels(module)


# Error paths that format a number, called once after each build (library_check.verify): a slot
# past the pool for the CPU op; a block past the pool for the CUDA kernels (copy_blocks checks its
# block numbers before any CUDA call, so this runs without a GPU, and on the CPU build too).
CPU_OP_PROBE = ("m.reshape_and_cache(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), "
                "torch.zeros(2, 1, 1, 16, 4), torch.zeros(2, 1, 4, 16), torch.tensor([99]))",
                r"slot_mapping\[0\] = 99\b")
CUDA_PROBE = ("m.copy_blocks([torch.zeros(6, 1, 1, 16, 4)], [torch.zeros(6, 1, 4, 16)], "
              "torch.tensor([[0, 9]]))", r"block numbers must be in \[0, 6\)")
# paged_attention.cu is compiled three times, each a part of its instances (see that file)
CUDA_SOURCES = ("torch_bindings.cpp", "paged_attention.cu", "paged_attention_8bit.cu",
                "paged_attention_grouped.cu", "cache_kernels.cu", "layer_kernels.cu",
                "gguf_matmul.cu")
# NOTE: every header beside them, so that a new one is copied into the build folder and part of
# its digest without anyone having to list it (a build compiles from that copy).
CUDA_HEADERS = tuple(sorted([*CSRC.glob("*.h"), *CSRC.glob("*.cuh")]))


def _make_cuda_op(job: JitBuild) -> CudaKernels | None:
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        return None  # a CPU (or ROCm) build of torch, or no GPU: the torch reference runs
    major, minor = torch.cuda.get_device_capability()
    return CudaKernels(compile_cuda_extension(job, f"{major}{minor}"))


def compile_cuda_extension(job: JitBuild, arch: str):
    """The CUDA kernels compiled for one GPU architecture ("90" for sm_90), checked by their
    probe. Needs a CUDA build of torch and nvcc, not a GPU (``scripts/check_compiled_ops.py``
    builds it on a machine without one)."""
    import torch

    # NOTE: an explicit -gencode for this GPU only: a quick build, and torch adds no arch flags
    # of its own when it sees one among ours. No -std flag: torch picks the C++ standard its
    # own headers need (the .cu files are plain C++17 and build with either).
    return compile_extension(
        job, name=f"minipaged_cuda_sm{arch}", tag=f"cuda{torch.version.cuda}-sm{arch}",
        sources=[CSRC / s for s in CUDA_SOURCES], depends=CUDA_HEADERS,
        probe=CUDA_PROBE, extra_cflags=["-O2"],
        extra_cuda_cflags=["-O2", f"-gencode=arch=compute_{arch},code=sm_{arch}"])


CPU_OP = JitBuild("the C++ CPU attention op", "1-2 min on 2 cores", _make_cpu_op,
                  switch="MINIPAGED_CPU_OP")
CUDA_OP = JitBuild("the CUDA kernels", "~1 min", _make_cuda_op, switch="MINIPAGED_CUDA_OP")


def start_background_build(device) -> None:
    """Start building the op of ``device`` in a daemon thread, so that it overlaps model loading.

    Args:
        device: a ``torch.device`` (or its name): "cpu" builds the C++ CPU op, "cuda" the CUDA
            kernels. A no-op when that op is switched off, already built or being built, and
            for any other device.
    """
    kind = getattr(device, "type", str(device).split(":")[0])
    job = {"cpu": CPU_OP, "cuda": CUDA_OP}.get(kind)
    if job is not None:
        job.start_in_background()


def prebuild() -> None:
    """Build the C++ CPU op now (and the CUDA kernels where a GPU is present); never raises,
    so that a machine without a compiler still finishes its set-up (with a warning)."""
    import torch

    for job in (CPU_OP, CUDA_OP) if torch.cuda.is_available() else (CPU_OP,):
        if job.enabled() and job.load() is None:
            print(f"minipaged: warning: {job.what} could not be built here; the torch reference "
                  "will run instead (slower)", file=sys.stderr)
