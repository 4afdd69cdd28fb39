"""Lesson 05: the one build helper of the compiled ops (minipaged/kernels/build.py).

The builds here are stand-ins (a ``make`` that waits on an event, a fake ``cpp_extension.load``),
so these tests check the helper's promises without compiling anything: one build per process
even with two threads asking, a background build that ``load()`` waits for, the switch, a
progress line only when a compile runs, and a set-up step that never fails.
"""
import threading
from pathlib import Path

import pytest
import torch

from minipaged.kernels import build

pytestmark = pytest.mark.lesson05


def slow_build(switch="MINIPAGED_TEST_OP", strict=False, fail=False):
    """(job, started, release, made): ``make`` records its call, says it started, then waits
    for ``release`` before returning a fresh object (or raising)."""
    started, release, made = threading.Event(), threading.Event(), []

    def make(job):
        made.append(threading.current_thread().name)
        started.set()
        assert release.wait(10)
        if fail:
            raise RuntimeError("no compiler here")
        return object()

    return build.JitBuild("a test op", "~0 s", make, switch=switch, strict=strict), started, \
        release, made


def test_load_waits_for_the_background_build_instead_of_building_again():
    job, started, release, made = slow_build()
    job.start_in_background()
    assert started.wait(10)
    job.start_in_background()  # already being built: no second thread
    results = []
    waiter = threading.Thread(target=lambda: results.append(job.load()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "load() returned before the background build finished"
    release.set()
    waiter.join(10)
    assert results[0] is not None and results[0] is job.load()
    assert len(made) == 1 and made[0].startswith("minipaged build")
    assert job.built()


def test_two_threads_asking_at_once_build_once():
    job, _, release, made = slow_build()
    results = []
    threads = [threading.Thread(target=lambda: results.append(job.load())) for _ in range(2)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert len(made) == 1 and len(results) == 2 and results[0] is results[1]


def test_the_switch_turns_the_op_off_and_no_build_starts(monkeypatch):
    job, _, release, made = slow_build()
    release.set()
    monkeypatch.setenv("MINIPAGED_TEST_OP", "0")
    job.start_in_background()
    assert job.load() is None and made == [] and not job.built()
    monkeypatch.setenv("MINIPAGED_TEST_OP", "1")  # any value but "0" means on
    assert job.load() is not None and len(made) == 1


def test_start_background_build_picks_the_op_of_the_device(monkeypatch):
    cpu_job, cpu_started, cpu_release, cpu_made = slow_build(switch="MINIPAGED_CPU_OP")
    cuda_job, _, cuda_release, cuda_made = slow_build(switch="MINIPAGED_CUDA_OP")
    monkeypatch.setattr(build, "CPU_OP", cpu_job)
    monkeypatch.setattr(build, "CUDA_OP", cuda_job)
    monkeypatch.setenv("MINIPAGED_CUDA_OP", "0")
    build.start_background_build(torch.device("meta"))  # no op for that device: nothing
    build.start_background_build(torch.device("cuda"))  # switched off: nothing
    build.start_background_build(torch.device("cpu"))
    assert cpu_started.wait(10)
    cpu_release.set()
    cuda_release.set()
    assert cpu_job.load() is not None
    assert len(cpu_made) == 1 and cuda_made == []


def test_a_failed_build_warns_once_or_raises_when_strict():
    job, _, release, made = slow_build(fail=True)
    release.set()
    with pytest.warns(RuntimeWarning, match="(?s)building a test op failed.*no compiler here"):
        assert job.load() is None
    assert job.load() is None and len(made) == 1  # tried once, warned once
    strict, _, release, made = slow_build(strict=True, fail=True)
    release.set()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no compiler here"):
            strict.load()
    assert len(made) == 1


def test_a_progress_line_only_when_a_compile_runs(tmp_path, monkeypatch, capsys):
    from torch.utils import cpp_extension

    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "op.cpp"
    source.write_text("// an op\n")
    loads = []

    def fake_load(name, sources, build_directory, **kwargs):
        loads.append((build_directory, sources, kwargs))
        library = Path(build_directory) / f"{name}.so"
        library.write_text("lib")
        return type("Module", (), {"__file__": str(library), "__name__": name})

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    job = build.JitBuild("the test op", "~1 s", lambda job: None)
    build.compile_extension(job, "test_op", "cpu-TEST", [source])
    err = capsys.readouterr().err
    assert "minipaged: building the test op (first use only, ~1 s)..." in err
    assert "the test op built in" in err
    folder, sources, kwargs = loads[0]
    assert Path(folder).parent == tmp_path / "cache" / "torch_ext"
    assert Path(folder).name.startswith(f"cpu-TEST-torch{torch.__version__}-")
    assert sources == [str(Path(folder) / "src" / "op.cpp")]  # compiled from the folder's copy
    assert kwargs["extra_ldflags"][0] == build.SHARED_CXX_RUNTIME
    build.compile_extension(job, "test_op", "cpu-TEST", [source])  # cached library: silent
    assert capsys.readouterr().err == "" and len(loads) == 2


def test_prebuild_never_fails_the_set_up(monkeypatch, capsys):
    job, _, release, _ = slow_build(switch="MINIPAGED_CPU_OP", fail=True)
    release.set()
    monkeypatch.setattr(build, "CPU_OP", job)
    with pytest.warns(RuntimeWarning):
        build.prebuild()
    assert "could not be built here" in capsys.readouterr().err


# The real CPU op's build in a fresh process, with sys.meta_path replaced by a list that notes
# which thread changes it. Python walks that list in place for every import, so a change made by
# the build thread can make another thread's import skip the finder of installed packages.
_META_PATH_SPY = r"""
import sys, threading
class Spy(list):
    changes = []
    def insert(self, i, x):
        Spy.changes.append(threading.current_thread().name); super().insert(i, x)
    def remove(self, x):
        Spy.changes.append(threading.current_thread().name); super().remove(x)
sys.meta_path = Spy(sys.meta_path)
from minipaged.kernels import build
assert "setuptools" not in sys.modules  # (else this process cannot show the change)
build.start_background_build("cpu")
build.CPU_OP.load()
print("changes:", Spy.changes)
print("by other threads:", [t for t in Spy.changes if t != "MainThread"])
"""


def test_a_background_build_never_changes_the_import_finders_another_thread_walks():
    """CI saw installed packages "not found" (markupsafe, regex, a transformers module) at the
    first model load of a lesson's kernel: setuptools' first import, in the build thread, put a
    finder at the front of sys.meta_path and took it out while the main thread imported."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "MINIPAGED_CPU_OP": "1"}
    run = subprocess.run([sys.executable, "-c", _META_PATH_SPY], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr
    assert "by other threads: []" in run.stdout, run.stdout
    assert "changes: ['MainThread'" in run.stdout, run.stdout  # setuptools did change it
