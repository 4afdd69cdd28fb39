"""Lesson 05: a build killed midway never hangs the next process (kernels/build_cache.py).

slow: two real compiles of a tiny torch extension, ~60-120 s on the 2-core machine.

A child starts a real JIT build through ``build.compile_extension``; as soon as the compiler runs
(torch's ``lock`` file is there) the child and its compiler are killed with SIGKILL, as a test
timeout or a crashed notebook kernel would. Before the fix the next process waited on torch's
lock file forever, silently; now it takes the lock the kernel released, clears the killed
build's leftovers, builds, and its op runs.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.lesson05, pytest.mark.slow]

TINY_OP = """
#include <torch/extension.h>
int64_t twice(int64_t n) { return 2 * n; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""

BUILD_AND_RUN = textwrap.dedent("""
    import sys
    from pathlib import Path
    from minipaged.kernels import build
    job = build.JitBuild("the tiny test op", "~30 s", lambda job: None)
    m = build.compile_extension(job, "tiny_kill_test", "cpu-TEST", [Path(sys.argv[1])])
    print("twice(21) =", m.twice(21), flush=True)
""")


def test_the_next_process_builds_and_runs_after_a_build_killed_midway(tmp_path):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_OP)
    env = {**os.environ, "MINIPAGED_CACHE": str(tmp_path / "cache")}
    first = subprocess.Popen([sys.executable, "-c", BUILD_AND_RUN, str(source)], env=env,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    root = tmp_path / "cache" / "torch_ext"
    deadline = time.monotonic() + 300
    while not list(root.glob("cpu-TEST-*/lock")):  # torch's lock: the compile has started
        assert first.poll() is None, f"the first build ended early: {first.stderr.read()}"
        assert time.monotonic() < deadline, "the first build never started compiling"
        time.sleep(0.2)
    time.sleep(2)  # well inside the compile
    os.killpg(first.pid, signal.SIGKILL)  # the child and its compiler, mid-build
    first.wait()
    stale = list(root.glob("cpu-TEST-*/lock"))
    assert stale, "the killed build should have left torch's lock file (the old hang's cause)"

    start = time.monotonic()
    second = subprocess.run([sys.executable, "-c", BUILD_AND_RUN, str(source)], env=env,
                            capture_output=True, text=True, timeout=600)
    took = time.monotonic() - start
    print(f"killed build left {stale[0]}; the next process took {took:.0f} s:\n{second.stderr}"
          f"{second.stdout}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "twice(21) = 42" in second.stdout
    assert "a build was killed here; removing its stale lock" in second.stderr
    assert not list(root.glob("cpu-TEST-*/lock"))
