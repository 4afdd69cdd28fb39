"""The package's own source in a lesson: one function, or one part of it, never a whole module.

    show_source(Scheduler.schedule, start="# 1.", end="# 2.")
    show_file_part("csrc/paged_attention.cu", "// ---- phase 3", "// ---- phase 4")

Lessons show the code they teach from the package (so the two never drift apart). A listing
longer than ``max_lines`` is shown in parts: ``start``/``end`` pick the lines from the first one
containing ``start`` up to (not including) the next one containing ``end``. ``show_file_part``
does the same for a file of the repository that is not Python (the CUDA kernels).
"""
from __future__ import annotations

import inspect
import pathlib
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


REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def file_part(path: str, start: str, end: str | None = None) -> str:
    """Lines of the repository file ``path`` from the first one containing ``start`` up to (not
    including) the next one containing ``end`` (to the end of the file without ``end``)."""
    lines = (REPO_ROOT / path).read_text().splitlines()
    first = next((i for i, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"{start!r} is not in {path}")
    stop = len(lines) if end is None else next(
        (i for i in range(first + 1, len(lines)) if end in lines[i]), len(lines))
    return "\n".join(lines[first:stop]).rstrip() + "\n"


def show_file_part(path: str, start: str, end: str | None = None, language: str = "cuda",
                   max_lines: int = MAX_LINES) -> None:
    """Display ``file_part(path, start, end)`` with syntax highlighting, at most ``max_lines``."""
    from IPython.display import Code, display

    code = file_part(path, start, end)
    lines = code.splitlines()
    if len(lines) > max_lines:
        code = "\n".join(lines[:max_lines]) + f"\n// ... {len(lines) - max_lines} more lines\n"
    comment = "#" if language == "python" else "//"
    display(Code(f"{comment} {path} (part)\n" + code,
                 language=language))
