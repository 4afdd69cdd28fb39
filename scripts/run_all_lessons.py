"""Run All of every lesson, as a learner first meets it: headless, every exercise unanswered.

Each lesson runs as JupyterLab's Run All runs it: every cell in order, in a fresh kernel, with
``MINIPAGED_SOLUTIONS`` unset (so each checker says "not done yet" and the cells after it go on
with the package's own function). The lesson runs from a copy in a temporary folder, which is
removed afterwards: a cell that writes a file leaves nothing in ``lessons/``. An error in a cell
does not stop the run (Run All would stop there; here the later cells run too, so that every
error cell is listed).

    python scripts/run_all_lessons.py                       # all lessons
    python scripts/run_all_lessons.py lessons/05_kernel.ipynb --timeout 900

Prints one row per lesson (seconds, error cells by index and exception name) and a total; exits
1 if any cell ended in an error. (``tests/lessons/test_lessons_unanswered.py`` runs the same
function, one lesson per test.)
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def execute_unanswered(path: Path, timeout: int = 600):
    """(the executed notebook, seconds) of the lesson at ``path``: a fresh kernel, every cell in
    order, MINIPAGED_SOLUTIONS unset, run from a temporary copy that is removed afterwards."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "MINIPAGED_SOLUTIONS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    with tempfile.TemporaryDirectory(prefix="minipaged-run-all-") as folder:
        copy = Path(folder) / path.name
        shutil.copyfile(path, copy)
        client = nbclient.NotebookClient(notebook, timeout=timeout, allow_errors=True,
                                         kernel_name="python3",
                                         resources={"metadata": {"path": folder}})
        start = time.perf_counter()
        client.execute(env=env)
        return notebook, time.perf_counter() - start


def error_cells(notebook) -> list[tuple[int, str]]:
    """[(cell index, exception name)] of every code cell whose output is an error, in order."""
    return [(i, out["ename"]) for i, cell in enumerate(notebook.cells)
            if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]


def table(rows: list[tuple[str, float, list[tuple[int, str]]]]) -> str:
    """The printed table: one row per (lesson, seconds, error cells), then the total."""
    width = max([len("lesson"), len("total")] + [len(name) for name, _, _ in rows])
    lines = [f"{'lesson':{width}}  {'seconds':>8}  error cells",
             f"{'-' * width}  {'-' * 8}  {'-' * 11}"]
    for name, seconds, errors in rows:
        shown = ", ".join(f"{i} {ename}" for i, ename in errors) or "-"
        lines.append(f"{name:{width}}  {seconds:8.1f}  {shown}")
    errors = sum(len(e) for _, _, e in rows)
    with_errors = sum(1 for _, _, e in rows if e)
    lines.append(f"{'total':{width}}  {sum(s for _, s, _ in rows):8.1f}  "
                 f"{errors} error cell(s) in {with_errors} of {len(rows)} lesson(s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", type=Path,
                        help="lesson notebooks (default: every lesson in lessons/)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.lessons if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    rows = []
    for path in args.lessons or sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb")):
        notebook, seconds = execute_unanswered(path, args.timeout)
        rows.append((path.stem, seconds, error_cells(notebook)))
        print(f"{path.stem}: {seconds:.1f} s, {len(rows[-1][2])} error cell(s)", flush=True)
    print(table(rows))
    return 1 if any(errors for _, _, errors in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
