"""Run the lessons as a learner who answered the build track, then the capstone.

Two answer sets. ``--answers reference`` (the default): every code cell tagged as a build-track
stub, cell metadata ``{"minipaged": {"component": "Name"}}``, gets the reference answer of
component ``Name`` (``minipaged/exercises/answers/``) in place of its stub: the class or function
in the cell whose body calls ``not_done()`` (or the C++ string that contains it) is replaced by
the answer's source, renamed to the stub's name (the rest of the cell stays). ``--answers
learner``: the answers of ``scripts/learner_answers/lessonNN.py``, written as a learner writes
them, with the lesson's own imports, helpers in cells of their own (inserted before the stub's
cell) and other names and structure (that folder's README says how a file is read).

The lessons then run headless, in order, as a learner runs them: without
``MINIPAGED_SOLUTIONS``, so each check passes on the typed answer and saves it under a fresh
``MINIPAGED_LEARNER_DIR`` (and checks the saved copy again); lesson 16's capstone then collects
them all and must match ``LLM()`` with every component the learner's.

    python scripts/answer_lessons.py                  # every lesson with a tagged cell
    python scripts/answer_lessons.py --answers learner
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
LEARNER_ANSWERS = ROOT / "scripts" / "learner_answers"
CELL_MARK = re.compile(r"^# %%.*$", re.M)


def component_of(cell) -> str | None:
    """The component a stub cell is tagged with, or None."""
    return (cell.get("metadata", {}).get(TAG) or {}).get("component")


def _calls_not_done(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "not_done"
               for n in ast.walk(node))


def _defined_name(node: ast.AST) -> str | None:
    """The name a top-level statement defines: a def, a class, or ``NAME = ...``."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)):
        return node.targets[0].id
    return None


def stubs_in(source: str) -> dict[str, ast.AST]:
    """The stubs of a cell by name: a class or function calling ``not_done()``, or a string
    (lesson 06's C++) containing it."""
    found = {}
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython syntax (magics): no stub there
        return found
    for node in tree.body:
        name = _defined_name(node)
        if name is None:
            continue
        if isinstance(node, ast.Assign):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str) \
                    and "not_done()" in value.value:
                found[name] = node
        elif _calls_not_done(node):
            found[name] = node
    return found


def _replace(source: str, node: ast.AST, text: str) -> str:
    """``source`` with the lines of ``node`` (and its decorators) replaced by ``text``."""
    lines = source.splitlines(keepends=True)
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    lines[first - 1:node.end_lineno] = [text if text.endswith("\n") else text + "\n"]
    return "".join(lines)


def answer_source(name: str) -> tuple[str, str]:
    """(the reference answer's source, the module it comes from) of component ``name``."""
    sys.path.insert(0, str(ROOT))
    from minipaged.exercises import workbench

    spec = workbench.component(name)
    module, _, attribute = spec.solution.partition(":")
    answer = spec.solution_object()
    if isinstance(answer, str):  # C++ source: the assignment that holds it
        return f"{attribute} = r\"\"\"{answer}\"\"\"\n", module
    return inspect.getsource(answer), module


def typed_in(source: str, name: str) -> str:
    """A stub cell's source with the stub replaced by the reference answer of ``name``."""
    stubs = stubs_in(source)
    if not stubs:
        raise ValueError(f"the cell tagged {name!r} has no class or function calling not_done()")
    answer, module = answer_source(name)
    answer_name = _defined_name(ast.parse(answer).body[0])
    for stub_name, stub in sorted(stubs.items(), key=lambda item: -item[1].lineno):
        # from the bottom, so earlier line numbers stay right
        renamed = re.sub(rf"^(\s*(?:def|class)\s+|){re.escape(answer_name)}\b",
                         rf"\g<1>{stub_name}", answer, count=1, flags=re.M)
        source = _replace(source, stub, renamed)
    # the answer's module-level names (its imports), as the learner's own imports would be
    return f"from {module} import *  # the names the answer uses\n" + source


def learner_cells(lesson: Path) -> list[str]:
    """The cells of a lesson's learner answers (``scripts/learner_answers/lessonNN.py``)."""
    path = LEARNER_ANSWERS / f"lesson{lesson.name[:2]}.py"
    if not path.exists():
        raise FileNotFoundError(f"no learner answers for {lesson.name}: {path} is missing")
    parts = CELL_MARK.split(path.read_text())[1:]  # the module docstring comes first
    return [part.strip("\n") + "\n" for part in parts if part.strip()]


def answered_by_learner(notebook, lesson: Path) -> list[str]:
    """Put the learner's cells into ``notebook``: each answer in place of the stub of the same
    name, the helper cells before it as new cells just above the stub's cell. Returns the
    names answered."""
    import nbformat

    helpers: list[str] = []
    answered: list[str] = []
    for cell_source in learner_cells(lesson):
        names = {_defined_name(node) for node in ast.parse(cell_source).body} - {None}
        where = [(i, cell) for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
                 and names & set(stubs_in(cell.source))]
        if not where:
            helpers.append(cell_source)  # a helper: it goes in before the next answer
            continue
        index, cell = where[0]
        stubs = stubs_in(cell.source)
        name = next(n for n in names if n in stubs)
        cell.source = _replace(cell.source, stubs[name], cell_source)
        notebook.cells[index:index] = [nbformat.v4.new_code_cell(h) for h in helpers]
        answered.append(name)
        helpers = []
    if helpers:
        raise ValueError(f"{lesson.name}: learner cells after the last answer answer nothing:\n"
                         + helpers[0][:200])
    missing = [component_of(c) for c in notebook.cells
               if c.cell_type == "code" and component_of(c) and stubs_in(c.source)]
    if missing:
        raise ValueError(f"{lesson.name}: no learner answer for {', '.join(missing)}")
    return answered


def run_lesson(path: Path, env: dict, timeout: int,
               answers: str = "reference") -> tuple[object, float, list[str]]:
    """(the executed notebook, seconds, [errors]) of the lesson with its stubs answered."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    if answers == "learner":
        answered_by_learner(notebook, path)
    else:
        for cell in notebook.cells:
            name = component_of(cell)
            if cell.cell_type == "code" and name:
                cell.source = typed_in(cell.source, name)
    client = nbclient.NotebookClient(notebook, timeout=timeout, allow_errors=True,
                                     kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute(env=env)
    errors = [f"cell {i}: {out['ename']}: {out['evalue']}{where(out)}"
              for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    return notebook, time.perf_counter() - start, errors


def where(error_output, frames: int = 8) -> str:
    """The last lines of an error cell's traceback (colours removed), so that a failure seen
    once in CI says where it came from."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in error_output.get("traceback", [])]
    tail = "\n".join(lines).splitlines()[-frames:]
    return "".join(f"\n    | {line}" for line in tail)


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
    parser.add_argument("--answers", choices=("reference", "learner"), default="reference",
                        help="the reference answers, or scripts/learner_answers/ (written as a "
                             "learner writes them)")
    args = parser.parse_args(argv)
    import nbformat

    lessons = sorted(args.lessons or tagged_lessons(), key=lambda p: p.name)
    capstone = ROOT / "lessons" / "16_capstone.ipynb"
    lessons = [p for p in lessons if p.resolve() != capstone] + [capstone]  # the capstone last
    learner = args.keep or Path(tempfile.mkdtemp(prefix="minipaged-learner-"))
    env = {k: v for k, v in os.environ.items() if k != "MINIPAGED_SOLUTIONS"}
    env["MINIPAGED_LEARNER_DIR"] = str(learner)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    print(f"answers: {args.answers}; learner directory: {learner}")
    failures: list[str] = []
    for path in lessons:
        names = [component_of(c) for c in nbformat.read(path, as_version=4).cells
                 if component_of(c)]
        notebook, seconds, errors = run_lesson(path, env, args.timeout, args.answers)
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
