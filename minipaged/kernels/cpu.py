"""The fast CPU paged attention, compiled just in time (lesson 05, next to the CUDA kernel).

``load()`` builds ``csrc/cpu/attention.cpp`` with ``torch.utils.cpp_extension.load`` the first
time it is called and returns a ``CpuKernels`` object with three operations, the same signatures
as their torch references in ``minipaged.kernels.ops``:

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale) -> out
    paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale) -> out

Every argument is checked in C++ before the loops run (shapes, dtypes, block numbers within the
sequences' contexts, context lengths, slots); a bad one raises a RuntimeError that names it, its
value and the limit, instead of reading or writing outside a tensor. Slot -1 means "not cached".

It returns None (and ``minipaged.kernels.ops`` runs its plain torch code) when ``MINIPAGED_CPU_KERNELS=0``
is set, or when the build fails (no C++ compiler, for instance): then a warning says so, once.
The compiled library is cached on disk under ``~/.cache/minipaged/torch_ext`` (or
``$MINIPAGED_EXT_DIR``), keyed by torch version and the CPU's vector instructions, and rebuilt when
the source changes. ``calls`` counts the calls of each operation, so tests can assert that the
compiled code, not the reference, ran.
"""
from __future__ import annotations

import collections
import functools
import os
import warnings
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "attention.cpp"

# Compiler flags per vector instruction set torch reports for this CPU.
_ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

calls: collections.Counter = collections.Counter()  # operation name -> number of calls


def enabled() -> bool:
    """False when ``MINIPAGED_CPU_KERNELS=0`` asks for the torch reference."""
    return os.environ.get("MINIPAGED_CPU_KERNELS", "1") != "0"


def cpu_capability() -> str:
    """The vector instructions torch found on this CPU: 'AVX512', 'AVX2', 'DEFAULT', ..."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - very old torch
        return "DEFAULT"


def load():
    """The compiled operations as a ``CpuKernels``, or None where they cannot be used."""
    if not enabled():
        return None
    return _build()


@functools.cache  # NOTE: one build (or one failed try, one warning) per process
def _build():
    try:
        import torch
        from torch.utils import cpp_extension

        from minipaged.kernels.cuda import _make_ninja_findable

        _make_ninja_findable(cpp_extension)
        capability = cpu_capability()
        cache_root = Path(
            os.environ.get("MINIPAGED_EXT_DIR", Path.home() / ".cache" / "minipaged" / "torch_ext")
        )
        build_dir = cache_root / f"torch{torch.__version__}-cpu-{capability}"
        build_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: -fopenmp makes at::parallel_for (a header template) run on torch's thread pool;
        # without it the loops would run on one thread.
        flags = ["-O3", "-fopenmp", *_ARCH_FLAGS.get(capability, [])]
        module = cpp_extension.load(
            name=f"minipaged_cpu_{capability.lower()}",
            sources=[str(SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=os.environ.get("MINIPAGED_VERBOSE_BUILD", "") not in ("", "0"),
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch reference"
        warnings.warn(
            "minipaged: building the C++ CPU attention failed, so the plain torch reference runs "
            f"instead (slower). Set MINIPAGED_CPU_KERNELS=0 to skip the build.\n"
            f"{type(exc).__name__}: {exc}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return CpuKernels(module)


class CpuKernels:
    """Thin wrappers: integer tensors to the types the C++ code reads, checks in C++."""

    def __init__(self, module):
        self.module = module

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        import torch

        calls["reshape_and_cache"] += 1
        slot_mapping = slot_mapping.to(dtype=torch.long).contiguous()
        self.module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(self, query, key_cache, value_cache, block_tables, context_lens, scale):
        calls["paged_attention"] += 1
        return self.module.paged_attention(_last_dim_contiguous(query), key_cache, value_cache,
                                           _int32(block_tables), _int32(context_lens),
                                           float(scale))

    def paged_prefill_attention(self, query, key_cache, value_cache, block_tables,
                                query_start_loc, context_lens, scale):
        calls["paged_prefill_attention"] += 1
        return self.module.paged_prefill_attention(
            _last_dim_contiguous(query), key_cache, value_cache, _int32(block_tables),
            _int32(query_start_loc), _int32(context_lens), float(scale))


def _int32(t):
    import torch

    return t.to(dtype=torch.int32).contiguous()


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()
