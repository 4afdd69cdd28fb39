"""A fresh Python process that imports exactly what this one imports (tensor-parallel workers,
Ray's actors, the compiled ops' checks in a child).

The child is ``python -c`` (never multiprocessing's spawn, which re-imports the user's script),
and the first thing it does is take this process's ``sys.path`` as its own, as it is at the
call. NOTE: nothing is added to it, least of all a folder inside the package: with
``minipaged/`` on the path, its subpackages ``kernels``, ``models``, ``core``, ... would also be
top-level modules in the child, and a library that imports a package of that name (transformers
imports Hugging Face's ``kernels``) would get ours instead (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import json
import os
import sys

# The child's sys.path is replaced before anything but sys and json (both stdlib, and already
# imported by the interpreter's start-up) is imported.
_BOOT = "import sys, json; sys.path[:] = json.loads(sys.argv[1]); del sys.argv[1]\n"


def python_argv(code: str, *args: str) -> list[str]:
    """The command line of a child that runs ``code`` with this process's ``sys.path``.

    Args:
        code: Python source to run in the child (``python -c``); it sees ``sys.argv[1:]`` as
            ``args``, as a plain ``python -c code args...`` would.
        args: strings handed to the child.
    """
    return [sys.executable, "-c", _BOOT + code, json.dumps(sys.path), *map(str, args)]


def path_variable() -> str:
    """This process's ``sys.path`` as a ``PYTHONPATH`` value (the current folder for its empty
    entry), for a child whose command line another program writes (a Ray worker): its path then
    starts with ours, in our order."""
    return os.pathsep.join(entry or os.getcwd() for entry in sys.path)
