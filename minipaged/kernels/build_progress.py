"""What a process says while it waits for a background build (``build.py``) at its exit.

``make demo`` prints its answers while the C++ CPU op still compiles behind it, and the process
then waits for the compile, so that the next run starts with the op. That wait is never silent:
a line names the op and how far its compile is, and another follows every few seconds.
"""
from __future__ import annotations

import contextlib
import glob
import os
import signal
import sys
import time


def progress(job) -> str:
    """How far a ``JitBuild``'s compile is: "2 of 4 files compiled, 48 s so far" (the objects
    ninja has written into the build's folder, out of those it writes)."""
    done = len(list(job.folder.glob("*.o"))) if job.folder is not None else 0
    files = f"{min(done, job.num_objects)} of {job.num_objects} files compiled, " \
        if job.num_objects else ""
    return f"{files}{time.monotonic() - job.started:.0f} s so far"


def finish_before_exit(job, every: float = 10.0) -> None:
    """At the interpreter's exit: wait for ``job``'s background build if it still compiles,
    saying what is waited for and how far it is (a line every ``every`` seconds); Ctrl-C stops
    waiting (the next run compiles the op again; the build's lock dies with this process)."""
    thread = job._thread
    if thread is None or not thread.is_alive():
        return
    if not job.compiling:  # loading a library built before: a moment
        thread.join()
        return
    say = lambda line: print(f"minipaged: {line}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"waiting for {job.what} to finish compiling ({progress(job)}; a first build takes "
        f"{job.duration}), so that the next run starts with it; Ctrl-C skips it")
    try:
        while thread.is_alive():
            thread.join(timeout=every)
            if thread.is_alive():
                say(f"still compiling {job.what}: {progress(job)}")
    except KeyboardInterrupt:
        stop_compilers()
        say(f"stopped waiting; the next run compiles {job.what} again")


def stop_compilers() -> None:
    """Stop this process's child processes (ninja and its compilers): a process that no longer
    waits for its build must not leave them running behind it (Linux; elsewhere a no-op)."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def _descendants(pid: int) -> list[int]:
    found = []
    for children in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(children) as f:
            for child in map(int, f.read().split()):
                found += [child, *_descendants(child)]
    return found
