"""Lessons are committed without outputs: CI produces the executed versions, git stores prose and
code only."""
import json
import pathlib
import re

import pytest

LESSONS = sorted((pathlib.Path(__file__).resolve().parent.parent / "lessons").glob("*.ipynb"))


def test_lessons_are_numbered_once_each_from_01():
    numbers = [p.name[:3] for p in LESSONS]
    assert numbers[:6] == ["01_", "02_", "03_", "04_", "05_", "06_"]
    assert numbers[6:9] == ["07_", "08_", "09_"] and len(set(numbers)) == len(numbers)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_has_no_outputs_or_execution_counts(path):
    notebook = json.loads(path.read_text())
    dirty = [i for i, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} have outputs or execution counts; clear "
                       f"them (jupyter nbconvert --clear-output --inplace {path.name})")


# Lesson 05 moves to show_source when its exercises land (another round).
@pytest.mark.parametrize("path", [p for p in LESSONS if not p.name.startswith("05_")],
                         ids=lambda p: p.name)
def test_lesson_source_listings_are_parts_of_at_most_40_lines(path):
    """Lessons show the package's code through show_source, which keeps a listing to 40 lines,
    never a whole long function."""
    notebook = json.loads(path.read_text())
    code = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    assert "inspect.getsource" not in code, "use show_source (it limits the listing's length)"
    assert not re.search(r"^def show\(", code, re.M), "import show_source instead of a local show"
