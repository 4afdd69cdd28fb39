"""Lessons are committed without outputs: CI produces the executed versions, git stores prose and
code only."""
import json
import re

import pytest

from repo_paths import ROOT

LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))


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


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_source_listings_are_parts_of_at_most_40_lines(path):
    """Lessons show the package's code through show_source and the kernels' through
    show_file_part, which keep a listing to 40 lines, never a whole long function or file."""
    notebook = json.loads(path.read_text())
    code = "".join("".join(c["source"]) + "\n" for c in notebook["cells"]
                   if c["cell_type"] == "code")
    assert "inspect.getsource" not in code, "use show_source (it limits the listing's length)"
    assert not re.search(r"^def show(_cuda|_code|_file)?\(", code, re.M), \
        "import show_source / show_file_part instead of a local listing function"
    assert not re.search(r"\bCode\(", code), \
        "a listing of its own (IPython's Code) has no length limit: use show_source / show_file_part"


def _file_part_calls(code: str):
    """(path, start, end) of every show_file_part call whose arguments are string literals (or
    a module-level NAME = "path" of the notebook)."""
    names = dict(re.findall(r'^(\w+) = "([^"]+)"', code, re.M))
    for path, start, end in re.findall(
            r'show_file_part\((\w+|"[^"]+"),\s*"((?:[^"\\]|\\.)*)"(?:,\s*"((?:[^"\\]|\\.)*)")?',
            code):
        yield names.get(path, path.strip('"')), start, end or None


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_file_listings_fit_without_being_cut(path):
    """Every part of a file a lesson lists exists, and fits in 40 lines (nothing cut off)."""
    from visualizer.source import MAX_LINES, file_part

    notebook = json.loads(path.read_text())
    code = "".join("".join(c["source"]) + "\n" for c in notebook["cells"]
                   if c["cell_type"] == "code")
    for file, start, end in _file_part_calls(code):
        lines = file_part(file, start, end).splitlines()
        assert len(lines) <= MAX_LINES, f"{file} from {start!r} to {end!r}: {len(lines)} lines"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_leaves_no_model_in_the_temp_folder(path):
    """A lesson that saves a model (``save_pretrained``) saves it in a ``TemporaryDirectory``,
    which is removed when the kernel stops, never in a ``mkdtemp`` folder that outlives every run
    (lesson 09's 2-layer GPT-2 left 205 MB behind on each one)."""
    notebook = json.loads(path.read_text())
    code = "".join("".join(c["source"]) + "\n" for c in notebook["cells"]
                   if c["cell_type"] == "code")
    assert "mkdtemp" not in code, f"{path.name}: use tempfile.TemporaryDirectory, not mkdtemp"
    temporary = set(re.findall(r"^(\w+) = tempfile\.TemporaryDirectory\(", code, re.M))
    temp_dirs = {name for name, owner in re.findall(r"^(\w+) = (\w+)\.name$", code, re.M)
                 if owner in temporary}
    for target in re.findall(r"\.save_pretrained\((\w+)\)", code):
        assert target in temp_dirs, (f"{path.name}: save_pretrained({target}) must write into "
                                     f"a tempfile.TemporaryDirectory's .name")
