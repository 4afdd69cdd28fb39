"""The package's own source in a lesson: one function, or one part of it, never a whole module.

    show_source(Scheduler.schedule, start="# 1.", end="# 2.")

Lessons show the code they teach from the package (so the two never drift apart). A listing
longer than ``max_lines`` is shown in parts: ``start``/``end`` pick the lines from the first one
containing ``start`` up to (not including) the next one containing ``end``.
"""
from __future__ import annotations

import inspect
import textwrap

MAX_LINES = 40


def source_part(obj, start: str | None = None, end: str | None = None) -> str:
    """The source of ``obj``, or its lines from ``start`` up to ``end`` (dedented)."""
    lines = inspect.getsource(obj).splitlines()
    if start is not None:
        first = next((i for i, line in enumerate(lines) if start in line), None)
        if first is None:
            raise ValueError(f"{start!r} is not in the source of {obj.__qualname__}")
        lines = lines[first:]
    if end is not None:
        stop = next((i for i, line in enumerate(lines) if i and end in line), len(lines))
        lines = lines[:stop]
    return textwrap.dedent("\n".join(lines).rstrip() + "\n")


def show_source(obj, start: str | None = None, end: str | None = None,
                max_lines: int = MAX_LINES) -> None:
    """Display the source of ``obj`` (or a part of it) with syntax highlighting in a notebook."""
    from IPython.display import Code, display

    try:
        code = source_part(obj, start, end)
    except ValueError:  # the function was rewritten and lost its marker: show its beginning
        code = source_part(obj)
    lines = code.splitlines()
    if len(lines) > max_lines:
        code = "\n".join(lines[:max_lines]) + f"\n    # ... {len(lines) - max_lines} more lines\n"
    where = inspect.getsourcefile(obj).replace("\\", "/").rsplit("/minipaged/", 1)[-1]
    part = " (part)" if start or end else ""
    display(Code(f"# {obj.__module__}.{obj.__qualname__}{part}, in {where}\n" + code,
                 language="python"))
