"""Run the lessons as a learner who typed the reference answers, then the capstone.

Every code cell tagged as a build-track stub, cell metadata ``{"minipaged": {"component":
"Name"}}``, gets the reference answer of component ``Name`` in place of its stub: the class or
function in the cell whose body calls ``not_done()`` is replaced by the answer's source, renamed to
the stub's name (the rest of the cell stays). The lessons then run headless, in order, as a
learner runs them: without ``MINIPAGED_SOLUTIONS``, so each check passes on the typed answer and
saves it under a fresh ``MINIPAGED_LEARNER_DIR``; lesson 16's capstone then collects them all and
must match ``LLM()`` with every component the learner's.

    python scripts/answer_lessons.py                  # every lesson with a tagged cell
    python scripts/answer_lessons.py lessons/16_capstone.ipynb --keep /tmp/learner

Prints each lesson's time and its checks' messages; exits 1 if a tagged component's check did not
pass, a cell raised, or the capstone did not pass with all of the learner's components.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = "minipaged"  # cell.metadata[TAG]["component"] names the stub's component


def component_of(cell) -> str | None:
    """The component a stub cell is tagged with, or None."""
    return (cell.get("metadata", {}).get(TAG) or {}).get("component")


def _calls_not_done(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "not_done"
               for n in ast.walk(node))


def answer_source(name: str) -> tuple[str, str]:
    """(the reference answer's source, the module it comes from) of component ``name``."""
    sys.path.insert(0, str(ROOT))
    from minipaged.exercises import workbench

    spec = workbench.component(name)
    module = spec.solution.partition(":")[0]
    return inspect.getsource(spec.solution_object()), module


def typed_in(source: str, name: str) -> str:
    """A stub cell's source with the stub replaced by the reference answer of ``name``."""
    tree = ast.parse(source)
    stubs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
             and _calls_not_done(n)]
    if not stubs:
        raise ValueError(f"the cell tagged {name!r} has no class or function calling not_done()")
    answer, module = answer_source(name)
    lines = source.splitlines(keepends=True)
    for stub in reversed(stubs):  # from the bottom, so earlier line numbers stay right
        first = min([stub.lineno] + [d.lineno for d in stub.decorator_list])
        answer_name = ast.parse(answer).body[0].name
        renamed = re.sub(rf"^(\s*(?:def|class)\s+){re.escape(answer_name)}\b",
                         rf"\g<1>{stub.name}", answer, count=1, flags=re.M)
        lines[first - 1:stub.end_lineno] = [renamed]
    # the answer's module-level names (its imports), as the learner's own imports would be
    return f"from {module} import *  # the names the answer uses\n" + "".join(lines)


def run_lesson(path: Path, env: dict, timeout: int) -> tuple[object, float, list[str]]:
    """(the executed notebook, seconds, [errors]) of the lesson with its stubs answered."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        name = component_of(cell)
        if cell.cell_type == "code" and name:
            cell.source = typed_in(cell.source, name)
    client = nbclient.NotebookClient(notebook, timeout=timeout, allow_errors=True,
                                     kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute(env=env)
    errors = [f"cell {i}: {out['ename']}: {out['evalue']}"
              for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    return notebook, time.perf_counter() - start, errors


def printed(notebook) -> str:
    return "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []) if out.get("output_type") == "stream")


def tagged_lessons() -> list[Path]:
    import nbformat

    return [p for p in sorted((ROOT / "lessons").glob("*.ipynb"))
            if any(component_of(c) for c in nbformat.read(p, as_version=4).cells)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", type=Path,
                        help="lesson notebooks (default: every lesson with a tagged stub cell)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="the learner directory to save into (default: a fresh temp folder)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    import nbformat

    lessons = sorted(args.lessons or tagged_lessons(), key=lambda p: p.name)
    capstone = ROOT / "lessons" / "16_capstone.ipynb"
    lessons = [p for p in lessons if p.resolve() != capstone] + [capstone]  # the capstone last
    learner = args.keep or Path(tempfile.mkdtemp(prefix="minipaged-learner-"))
    env = {k: v for k, v in os.environ.items() if k != "MINIPAGED_SOLUTIONS"}
    env["MINIPAGED_LEARNER_DIR"] = str(learner)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    print(f"learner directory: {learner}")
    failures: list[str] = []
    for path in lessons:
        names = [component_of(c) for c in nbformat.read(path, as_version=4).cells
                 if component_of(c)]
        notebook, seconds, errors = run_lesson(path, env, args.timeout)
        text = printed(notebook)
        print(f"{path.stem}: {seconds:.1f} s, components {', '.join(names) or 'none'}")
        for line in text.splitlines():
            if line.startswith(("✓", "✗", "…")):
                print(f"  {line}")
        failures += [f"{path.stem}: {e}" for e in errors]
        failures += [f"{path.stem}: {n} did not pass its check" for n in names
                     if f"✓ {n}:" not in text]
        if path.resolve() == capstone and not re.search(r"^✓ capstone:", text, re.M):
            failures.append("the capstone did not pass with all of the learner's components")
    print(f"saved: {', '.join(sorted(p.stem for p in learner.glob('*.py'))) or 'nothing'}")
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
