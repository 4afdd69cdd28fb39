"""Servers in a subprocess on a free 127.0.0.1 port that always stop, and the system Chromium.

Shared by the serving tests (`minipaged serve`), the browser test (Voila) and the JupyterLab
lesson test.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.request

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()[-3000:]


@contextlib.contextmanager
def running_process(cmd: list[str], probe_url: str, *, log_path=None, timeout: float = 120.0,
                    **popen_kwargs):
    """Start ``cmd``, wait until ``probe_url`` answers 200, yield the process; stop it after.

    Raises with the end of the log if the process exits or does not answer in ``timeout`` s.
    """
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[2] if len(cmd) > 2 else cmd[0]} exited with "
                                   f"{proc.returncode}: {_tail(log_path)}")
            try:
                with urllib.request.urlopen(probe_url, timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer on {probe_url} within {timeout} s: "
                                   f"{_tail(log_path)}")
            time.sleep(0.25)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def chromium_path() -> str | None:
    """Debian's chromium, or None (the browser tests then skip: never download one)."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    return shutil.which("chromium")


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
