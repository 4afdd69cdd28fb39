"""One line naming the machine a benchmark ran on, for benchmarks/RESULTS.md."""
from __future__ import annotations

import os
import platform

import torch


def machine_description(device: torch.device | str = "cpu") -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


# the vector instructions a CPU's flags may name, as /proc/cpuinfo spells them -> as printed
_VECTOR_FLAGS = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX-512F",
                 "avx512_vnni": "AVX-512 VNNI", "avx512_bf16": "AVX-512 BF16",
                 "avx_vnni": "AVX-VNNI", "amx_bf16": "AMX BF16", "asimd": "NEON", "sve": "SVE"}


def cpu_features(cpuinfo: str | None = None) -> list[str]:
    """The vector instructions this CPU reports (read from its flags, never assumed): e.g.
    ``["AVX2", "FMA", "F16C", "AVX-512F", "AVX-512 BF16"]``; empty where nothing says."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return [shown for flag, shown in _VECTOR_FLAGS.items() if flag in flags]


def append_results(title: str, facts: list[str], note: str, body: str) -> str:
    """Append a section to benchmarks/RESULTS.md: ``## title (today)``, the facts as a list (and
    the note), then the body. Returns the file's path."""
    import datetime

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
    facts = facts + ([f"note: {note}"] if note else [])
    with open(path, "a") as f:
        f.write(f"\n## {title} ({datetime.date.today().isoformat()})\n\n"
                + "".join(f"- {fact}\n" for fact in facts) + f"\n{body}\n")
    return path
