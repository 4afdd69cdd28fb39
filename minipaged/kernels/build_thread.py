"""The thread a background build runs in (``build.py``'s ``JitBuild.start_in_background``).

Two things make such a thread safe to run beside the engine: what it imports is imported
before it starts, in the calling thread, and it takes only the CPU the engine leaves.
"""
from __future__ import annotations

import os
import sys


def before_a_build_thread() -> None:
    """Import what a build imports, in the calling thread, before a build thread starts.

    NOTE: ``torch.utils.cpp_extension`` imports setuptools, whose first import puts a finder at
    the front of ``sys.meta_path`` and takes it out again. Python looks a module up by walking
    that list in place, so a lookup in another thread at that moment can skip the finder of
    installed packages and fail: a package that is there is "not found" (seen in CI's full run,
    at the first model load of a lesson's kernel, while the main thread imported transformers).
    Imported here first, the build thread changes no list that another thread walks."""
    try:
        from torch.utils import cpp_extension  # noqa: F401
    except Exception:  # noqa: BLE001 - (no setuptools, ...): the build says so, as it did
        pass


def lower_this_threads_priority() -> None:
    """Let a background build take only the CPU the engine leaves.

    On Linux a thread's nice value is its own, and the compiler processes the thread starts
    inherit it: a first run's model conversion and generation then come first where they would
    compete for a core. Elsewhere ``os.nice`` would lower the whole process, so it is left alone
    there."""
    if sys.platform.startswith("linux"):
        try:
            os.nice(10)
        except OSError:  # (not allowed here: the build simply competes)
            pass
