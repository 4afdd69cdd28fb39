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
