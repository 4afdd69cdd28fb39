"""Is a freshly built library safe to load? Two checks after every build (lesson 05).

The failure they catch was seen on a GPU machine: every ``TORCH_CHECK`` whose message formats a
number ended the process with SIGSEGV instead of raising. The library had been linked with a
copy of libstdc++ of its own (224 stream and locale symbols: ``std::basic_ostream``,
``std::codecvt``, ...), as ``-static-libstdc++`` or a toolchain whose shared libstdc++ is missing
at link time produces. That private copy's locale is never set up (the process's libstdc++ set up
its own), so formatting a number through it fails: on this CPU machine the message loses
everything after the first number, on that GPU machine the process crashed. ``kernels/build.py``
now links the shared libstdc++ explicitly, so the private copy cannot be pulled in; these checks
catch it, or anything like it, wherever it comes from:

1. ``own_stream_symbols``: the library must define none of libstdc++'s stream code itself
   (read with ``nm -D``).
2. ``probe``: a first call of an error path, in a child process (a crash kills only the child),
   must raise a ``RuntimeError`` whose message ends with the number it formats.

``verify`` runs both once per library and keeps the verdict beside it, so a later process that
loads the same library pays nothing. A library that fails is not used: the CPU and CUDA ops fall
back to the torch reference with a warning that says why.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

from minipaged.child_process import python_argv

# Classes whose code lives in libstdc++.so: a library that defines any of them carries a copy.
STREAM_CODE = re.compile(r"\bstd::(?:__cxx11::)?(?:basic_ostream|basic_istream|basic_ios|"
                         r"basic_streambuf|basic_ostringstream|codecvt|num_put|num_get|"
                         r"locale|ios_base)\b")
PROBE_TIMEOUT = 180  # seconds: the child imports torch and loads the library


def own_stream_symbols(library: Path) -> list[str] | None:
    """The libstdc++ stream symbols ``library`` defines itself (an empty list when it defines
    none, as it should), or None where ``nm`` is not installed."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    listed = subprocess.run([nm, "-DC", "--defined-only", str(library)], capture_output=True,
                            text=True, check=False)
    symbols = []
    for line in listed.stdout.splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) == 3 and STREAM_CODE.search(fields[2]):
            symbols.append(fields[2])
    return symbols


# The child: import torch, load the library by path, call the probe, print what it raised.
_CHILD = r"""
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location(sys.argv[2], sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
try:
    exec(sys.argv[3])
except RuntimeError as error:
    print("RAISED:" + str(error).splitlines()[0])
else:
    print("NO ERROR")
"""


def probe(library: Path, module_name: str, call: str, expect: str) -> str | None:
    """Call an error path of ``library`` in a child process; None if it raised as it should,
    else what went wrong (``call_error_path`` gives the message too)."""
    return call_error_path(library, module_name, call, expect)[0]


def call_error_path(library: Path, module_name: str, call: str,
                    expect: str) -> tuple[str | None, str]:
    """Call an error path of ``library`` in a child process: (None if it raised as it should,
    else what went wrong; the first line of the message it raised, or "").

    Args:
        library: the ``.so`` file.
        module_name: the extension's module name (its ``PyInit_`` name).
        call: Python run in the child with the module as ``m`` and ``torch`` imported; it must
            raise a RuntimeError.
        expect: a regular expression the first line of the error message must match (end it
            with the number the message formats: a broken stream drops it).
    """
    try:
        child = subprocess.run(python_argv(_CHILD, library, module_name, call),
                               capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"its error-path probe did not finish in {PROBE_TIMEOUT} s", ""
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name
        return (f"its error-path probe died with {name} instead of raising a RuntimeError "
                f"(called: {call})"), ""
    raised = [line[len("RAISED:"):] for line in child.stdout.splitlines()
              if line.startswith("RAISED:")]
    if child.returncode != 0 or not raised:
        tail = (child.stdout + child.stderr).strip().splitlines()[-3:]
        return f"its error-path probe did not raise a RuntimeError: {' | '.join(tail)}", ""
    if not re.search(expect, raised[0]):
        return (f"its error message came out garbled: {raised[0]!r} does not match "
                f"{expect!r} (a number formatted by the library went missing)"), raised[0]
    return None, raised[0]


def verify(library: Path, module_name: str, call: str, expect: str) -> str | None:
    """Both checks, once per library file; None when it is safe to load, else why not.

    The verdict is kept in ``<library>.verified`` with the library's size and time stamp, so
    that a rebuilt library is checked again.
    """
    stamp = library.with_name(library.name + ".verified")
    stat = library.stat()
    identity = [stat.st_size, stat.st_mtime_ns]
    try:
        kept = json.loads(stamp.read_text())
        if kept.get("library") == identity:
            return kept.get("problem")
    except (OSError, ValueError):
        pass
    problem = None
    symbols = own_stream_symbols(library)
    if symbols:
        problem = (f"it defines {len(symbols)} symbols of libstdc++'s stream code itself (e.g. "
                   f"{symbols[0]}): it was linked with a private copy of the C++ runtime, whose "
                   "locale is never set up, so an error message that formats a number would "
                   "crash the process or lose the number")
    else:
        problem = probe(library, module_name, call, expect)
    stamp.write_text(json.dumps({"library": identity, "problem": problem}))
    return problem
