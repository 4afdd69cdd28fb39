"""Lesson 05: the compiled ops' folders and their lock (minipaged/kernels/build_cache.py).

No compiler runs here: the lock is held by child processes that sleep, and ``cpp_extension.load``
is a stand-in, so these tests check the promises cheaply: a lock that dies with its holder, a
stale torch lock removed, a waiting message, one folder per distinct build shared by identical
builds, and pruning that never touches a folder in use. ``test_kill_mid_build.py`` does the same
with a real compile killed midway.
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from minipaged.kernels import build, build_cache
from minipaged.kernels.build_progress import finish_before_exit

pytestmark = pytest.mark.lesson05

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from minipaged.kernels.build_cache import build_lock
    with build_lock(Path(sys.argv[1]), "a test op"):
        print("holding", flush=True)
        time.sleep(600)
""")


def hold_lock(folder: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "holding"
    return child


@pytest.mark.slow  # (4 s)
def test_the_lock_dies_with_its_holder_and_a_waiter_says_what_it_waits_for(tmp_path, capsys):
    folder = tmp_path / "build"
    holder = hold_lock(folder)
    (folder / "lock").write_text("")  # what torch leaves when its build is killed
    (folder / "half_written.o").write_text("partial")
    start = time.monotonic()
    # a crashed notebook kernel, a test timeout: the holder dies while we wait for it
    killer = threading.Timer(1.5, holder.send_signal, [signal.SIGKILL])
    killer.start()
    try:
        with build_cache.build_lock(folder, "a test op", notice_after=0.5):
            waited = time.monotonic() - start
            assert not (folder / "lock").exists(), "the stale torch lock must be removed"
            assert not (folder / "half_written.o").exists()
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"waiting for process {holder.pid}, which is building a test op" in err
    assert str(folder / build_cache.LOCK_NAME) in err
    assert "a build was killed here" in err
    assert 1.0 < waited < 30


def test_a_live_holder_keeps_the_folder_and_its_torch_lock(tmp_path):
    folder = tmp_path / "build"
    holder = hold_lock(folder)
    try:
        waiter = subprocess.run(
            [sys.executable, "-c", "import sys, fcntl; h = open(sys.argv[1], 'a+');"
             "fcntl.flock(h, fcntl.LOCK_EX | fcntl.LOCK_NB)",
             str(folder / build_cache.LOCK_NAME)], capture_output=True, text=True)
        assert waiter.returncode != 0 and "BlockingIOError" in waiter.stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_finished_build_leaves_no_torch_lock_and_its_folder_is_kept(tmp_path, capsys):
    """torch 2.14 flocks a ``lock`` file and leaves it after the build: read at the next
    build as a killed build's, it would wipe a good folder (and rebuild every time)."""
    folder = tmp_path / "build"
    with build_cache.build_lock(folder, "a test op"):
        (folder / "lock").write_text("")  # torch's lock, still there when its build returns
        (folder / "op.so").write_text("built")
    assert not (folder / "lock").exists()
    with build_cache.build_lock(folder, "a test op"):
        assert (folder / "op.so").read_text() == "built"
    assert "a build was killed here" not in capsys.readouterr().err


def test_the_key_names_everything_a_library_is_made_from():
    base = ("op", [("src/op.cpp", b"int f();")], ["-O2"])
    assert build_cache.build_key(*base) == build_cache.build_key(*base)
    assert build_cache.build_key("op", [("src/op.cpp", b"int g();")], ["-O2"]) != \
        build_cache.build_key(*base)
    assert build_cache.build_key("op", [("src/op.cpp", b"int f();")], ["-O3"]) != \
        build_cache.build_key(*base)


def test_copy_sources_keeps_the_time_stamp_of_an_unchanged_file(tmp_path):
    build_cache.copy_sources({"csrc/a.cpp": b"one"}, tmp_path)
    target = tmp_path / "csrc" / "a.cpp"
    os.utime(target, (1_000_000, 1_000_000))
    build_cache.copy_sources({"csrc/a.cpp": b"one"}, tmp_path)
    assert target.stat().st_mtime == 1_000_000
    build_cache.copy_sources({"csrc/a.cpp": b"two"}, tmp_path)
    assert target.read_bytes() == b"two" and target.stat().st_mtime > 1_000_000


def test_pruning_keeps_the_newest_and_never_a_folder_in_use(tmp_path):
    folders = [tmp_path / f"cpu-AVX2-torch2-{i:012x}" for i in range(6)]
    for folder in folders:
        folder.mkdir()
    holder = hold_lock(folders[0])  # the oldest, but someone is building in it
    for i, folder in enumerate(folders):
        os.utime(folder, (1000 + i, 1000 + i))
    try:
        removed = build_cache.prune_siblings(folders[5], keep=3)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(removed) == [folders[1], folders[2]]
    assert all(f.exists() for f in (folders[0], folders[3], folders[4], folders[5]))


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """A stand-in for cpp_extension.load that "compiles" only when the library is missing."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))
    compiles = []

    def fake_load(name, sources, build_directory, **kwargs):
        library = Path(build_directory) / f"{name}.so"
        if not library.exists():
            compiles.append(build_directory)
            library.write_text("".join(Path(s).read_text() for s in sources))
        return type("Module", (), {"__file__": str(library), "__name__": name})

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    return compiles


def two_checkouts(tmp_path, first: str, second: str):
    paths = []
    for name, text in (("checkout_a", first), ("checkout_b", second)):
        source = tmp_path / name / "op.cpp"
        source.parent.mkdir()
        source.write_text(text)
        paths.append(source)
    return paths


def test_two_checkouts_with_other_sources_never_rebuild_each_other(tmp_path, fake_compiler):
    a, b = two_checkouts(tmp_path, "// version A\n", "// version B\n")
    job = build.JitBuild("the test op", "~1 s", lambda job: None)
    folders = [build.compile_extension(job, "test_op", "cpu-TEST", [src]).__file__
               for src in (a, b, a, b, a)]
    assert len(fake_compiler) == 2, "alternating between two checkouts must not rebuild"
    assert folders[0] == folders[2] == folders[4] != folders[1] == folders[3]


def test_two_checkouts_with_the_same_sources_share_one_build(tmp_path, fake_compiler):
    a, b = two_checkouts(tmp_path, "// same\n", "// same\n")
    job = build.JitBuild("the test op", "~1 s", lambda job: None)
    first = build.compile_extension(job, "test_op", "cpu-TEST", [a]).__file__
    second = build.compile_extension(job, "test_op", "cpu-TEST", [b]).__file__
    assert first == second and len(fake_compiler) == 1
    assert Path(first).parent.name.startswith(f"cpu-TEST-torch{torch.__version__}-")


def test_a_refused_library_is_not_used_and_the_warning_says_why(monkeypatch):
    def make(job):
        raise build.LibraryRefused("the test op was built (x.so) but is not used: it defines "
                                   "224 symbols of libstdc++'s stream code itself")

    job = build.JitBuild("the test op", "~1 s", make, switch="MINIPAGED_TEST_OP")
    with pytest.warns(RuntimeWarning, match=r"(?s)is not used: it defines 224 symbols.*"
                                            r"torch reference runs instead"):
        assert job.load() is None


def test_while_a_background_build_compiles_the_reference_runs_then_the_op(tmp_path, fake_compiler,
                                                                          capsys):
    """A first run does not wait for the compiler: ``load_unless_compiling`` answers None while
    the background thread compiles (a line says so), and the op once it is built (a line says
    that too). A library built before is loaded and waited for: no reference step then."""
    source = tmp_path / "op.cpp"
    source.write_text("// op\n")
    release = threading.Event()
    from torch.utils import cpp_extension

    fake = cpp_extension.load

    def slow_load(**kwargs):
        release.wait(30)
        return fake(**kwargs)

    def make(job):
        return build.compile_extension(job, "test_op", "cpu-TEST", [source])

    job = build.JitBuild("the test op", "~1 s", make)
    cpp_extension.load = slow_load
    try:
        job.start_in_background()
        # at once, before the thread has hashed the sources: it waits for that, not the compile
        assert job.load_unless_compiling() is None
        assert job.compiling
        assert job.load_unless_compiling() is None
        release.set()
        job._thread.join(30)
        op = job.load_unless_compiling()
        assert op is not None and not job.compiling
    finally:
        cpp_extension.load = fake
        release.set()
    err = capsys.readouterr().err
    assert err.count("the test op is still compiling; the torch reference runs until it is "
                     "ready") == 1
    assert "the test op is ready: it runs from this step on" in err

    again = build.JitBuild("the test op", "~1 s", make)  # a new process: the library is built
    again.start_in_background()
    assert again.load_unless_compiling() is not None  # loaded and waited for, never None
    assert "still compiling" not in capsys.readouterr().err


def test_exit_says_what_it_waits_for_and_how_far_the_compile_is(tmp_path, fake_compiler,
                                                                capsys):
    """A process that ends while its background build compiles (``make demo`` after its
    answers) waits with a line that names the op, the files compiled so far and how long a first
    build takes, and another line while it goes on; never silently."""
    sources = [tmp_path / f"op{i}.cpp" for i in range(3)]
    for source in sources:
        source.write_text(f"// {source.name}\n")
    release = threading.Event()
    from torch.utils import cpp_extension

    fake = cpp_extension.load

    def slow_load(build_directory, **kwargs):
        (Path(build_directory) / "op0.o").write_text("")  # one object compiled so far
        release.wait(30)
        return fake(build_directory=build_directory, **kwargs)

    job = build.JitBuild("the test op", "1-2 min",
                         lambda job: build.compile_extension(job, "test_op", "cpu-TEST", sources))
    cpp_extension.load = slow_load
    try:
        job.start_in_background()
        job._decided.wait(30)
        threading.Timer(0.5, release.set).start()
        finish_before_exit(job, every=0.2)
    finally:
        cpp_extension.load = fake
        release.set()
    assert not job._thread.is_alive()
    err = capsys.readouterr().err
    assert re.search(r"waiting for the test op to finish compiling \([01] of 3 files compiled, "
                     r"\d+ s so far; a first build takes 1-2 min\), so that the next run starts "
                     r"with it; Ctrl-C skips it", err), err
    assert "still compiling the test op: 1 of 3 files compiled" in err
    assert job.load() is not None


def test_exit_after_a_finished_build_says_nothing(tmp_path, fake_compiler, capsys):
    source = tmp_path / "op.cpp"
    source.write_text("// op\n")
    job = build.JitBuild("the test op", "~1 s",
                         lambda job: build.compile_extension(job, "test_op", "cpu-TEST", [source]))
    job.start_in_background()
    job._thread.join(30)
    capsys.readouterr()
    finish_before_exit(job, every=0.1)
    assert "waiting" not in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value: Linux")
def test_a_background_build_runs_at_a_lower_priority_than_the_engine():
    """The compiler a background build starts inherits its thread's nice value: the engine's
    threads keep theirs (a first run's conversion and generation come first)."""
    seen = {}

    def make(job):
        seen["build"] = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's
        seen["compiler"] = int(subprocess.run(["sh", "-c", "cut -d' ' -f19 /proc/self/stat"],
                                              capture_output=True, text=True).stdout)
        return object()

    job = build.JitBuild("the test op", "~1 s", make)
    job.start_in_background()
    job._thread.join(30)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen["build"] == min(mine + 10, 19) and seen["compiler"] == seen["build"]
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # this thread keeps its own


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="children read from /proc")
def test_a_process_that_stops_waiting_stops_its_compilers():
    """Ctrl-C at the exit's wait: the compiler processes the build started go too (ninja's
    children, and theirs), so no orphan keeps compiling what the next run compiles again."""
    code = textwrap.dedent("""
        import subprocess, sys, time
        from minipaged.kernels.build_progress import _descendants, stop_compilers
        outer = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
        time.sleep(0.5)
        found = _descendants(outer.pid)
        print(len(found), flush=True)
        stop_compilers()
        outer.wait(10)
        print(outer.returncode, flush=True)
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
    found, returncode = child.stdout.split()
    assert int(found) == 1  # sh's sleep
    assert int(returncode) == -signal.SIGTERM
