"""The compiled ops' folders on disk: one per build, named by what was built, each behind a lock
that dies with its holder (lesson 05).

Three failures of a plain ``torch.utils.cpp_extension.load`` into a fixed folder, each seen on a
real machine, are what this module is for:

1. **A stale lock hangs every later process.** torch's JIT build marks its folder busy with a
   file named ``lock`` and deletes it when the build ends; a process killed mid-build (a test
   timeout, a crashed notebook kernel) leaves the file, and every later build in that folder
   waits for it forever, silently. Here each build first takes ``build_lock``: an ``fcntl.flock``
   on a file of its own, which the operating system releases when the holder dies, however it
   dies. Whoever holds it knows no other process builds in the folder, so a torch ``lock`` file
   found there is stale: it is removed, with the killed build's partial outputs.
2. **Two checkouts thrash one folder.** Two clones (or two build commands) whose sources differ
   rebuilt each other's library on every switch. The folder's name is now a digest of everything
   the library is made from (``build_key``): the sources' text, the flags, torch's version and
   install folder, the compiler; a different build gets a different folder and nothing is
   overwritten. The sources are compiled from a copy inside the folder, so two checkouts with the
   same sources share one build instead of rebuilding it for their different paths.
3. **A wait that says nothing looks like a hang.** A process that waits more than a few seconds
   for another's build says what it waits for and where the lock is.

Old folders of the same build (other sources, from before an edit) are pruned, newest kept.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

from minipaged.cache_paths import extensions_root

LOCK_NAME = ".minipaged-build.lock"  # ours, held with flock
TORCH_LOCK_NAME = "lock"  # torch's FileBaton: a plain file, stale if its builder was killed
WAIT_NOTICE_SECONDS = 3.0
KEEP_PER_BUILD = 3  # folders of one build (other sources) kept; older ones are pruned


def build_key(*parts) -> str:
    """A short digest of everything a library is made from (bytes, or anything with a repr)."""
    digest = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:12]


def toolchain_identity() -> tuple:
    """What besides the sources decides the library: torch's version and install folder (their
    headers and libraries), the compiler torch will call, and Python's version."""
    import torch

    compiler = os.environ.get("CXX", "c++")
    return (torch.__version__, str(Path(torch.__file__).resolve().parent), compiler,
            shutil.which(compiler), sys.version_info[:2])


def build_folder(tag: str, key: str) -> Path:
    """``<cache root>/torch_ext/<tag>-torch<version>-<key>``: one folder per distinct build."""
    import torch

    return extensions_root() / f"{tag}-torch{torch.__version__}-{key}"


def copy_sources(files: dict[str, bytes], folder: Path) -> None:
    """Write ``files`` (relative path -> content) under ``folder``, leaving a file untouched when
    its content is already there, so that its time stamp (and ninja's view of it) stays."""
    for relative, content in files.items():
        target = folder / relative
        if target.exists() and target.read_bytes() == content:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        temporary.write_bytes(content)
        os.replace(temporary, target)


@contextlib.contextmanager
def build_lock(folder: Path, what: str, notice_after: float = WAIT_NOTICE_SECONDS):
    """Hold the folder's build lock: an ``flock`` the operating system drops when the holder
    dies. Under it a torch ``lock`` file left by a killed build is removed, and so is the one a
    finished build leaves (torch 2.14 keeps its lock file).

    Args:
        folder: the build's folder (created if missing).
        what: what is built, for the waiting message.
        notice_after: seconds of waiting before a line on stderr says who is waited for.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    with open(path, "a+") as handle:
        _acquire(handle, path, what, notice_after)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            stale = folder / TORCH_LOCK_NAME
            if stale.exists():
                # NOTE: we hold the flock, so no build of ours runs in this folder: the file is
                # what a killed build left, and torch would wait for it forever. Its half-written
                # objects go too, so that the next build starts clean.
                print(f"minipaged: a build was killed here; removing its stale lock {stale} "
                      "and its partial outputs", file=sys.stderr, flush=True)
                for entry in folder.iterdir():
                    if entry.name != LOCK_NAME:
                        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            yield
        finally:
            # The build ended (built, or raised): torch 2.14 and later keep their lock as a
            # file they flock, and leave it behind. Found at the next build, it would read as a
            # killed build's and wipe a good folder; so it goes now. (Only a killed process
            # skips this, and its file is then the stale one above.)
            (folder / TORCH_LOCK_NAME).unlink(missing_ok=True)
            fcntl.flock(handle, fcntl.LOCK_UN)


def _acquire(handle, path: Path, what: str, notice_after: float) -> None:
    started = time.monotonic()
    told = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if told:
                print(f"minipaged: the lock is free after {time.monotonic() - started:.0f} s",
                      file=sys.stderr, flush=True)
            return
        except BlockingIOError:
            pass
        if not told and time.monotonic() - started >= notice_after:
            holder = path.read_text().strip() or "another process"
            print(f"minipaged: waiting for process {holder}, which is building {what} "
                  f"(lock: {path}); it is released when that build ends or its process dies",
                  file=sys.stderr, flush=True)
            told = True
        time.sleep(0.1)


def prune_siblings(folder: Path, keep: int = KEEP_PER_BUILD) -> list[Path]:
    """Remove the oldest folders of the same build (same tag and torch, other sources) beyond
    ``keep``; a folder whose lock someone holds is left alone. Returns what was removed."""
    prefix = folder.name.rsplit("-", 1)[0] + "-"
    siblings = [p for p in folder.parent.iterdir()
                if p.is_dir() and p.name.startswith(prefix) and p != folder]
    siblings.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = []
    for old in siblings[max(keep - 1, 0):]:
        lock = old / LOCK_NAME
        try:
            with open(lock, "a+") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(old, ignore_errors=True)
                removed.append(old)
        except (BlockingIOError, OSError):
            continue
    return removed
