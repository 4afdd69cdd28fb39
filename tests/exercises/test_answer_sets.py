"""Both answer sets of ``scripts/answer_lessons.py`` through the lessons and the capstone.

The reference set (``minipaged/exercises/answers/``) is written to be self-contained; the learner
set (``scripts/learner_answers/``) is written as a learner writes: the lessons' imports, helpers
in cells of their own, other names. Both must pass every tagged component's check (and the check
of its saved copy) and the capstone. The fast tests check how the script plays the learner's
cells into a notebook and each learner answer against its checker alone; the slow ones run every
lesson headless (``make test-all``).
"""
from __future__ import annotations

import itertools
import linecache
from pathlib import Path

import nbformat
import pytest

from minipaged.exercises import workbench
from repo_paths import load_script

def _harness():
    return load_script("answer_lessons")


harness = _harness()
LESSONS = harness.tagged_lessons()


def tagged(path: Path) -> list[str]:
    return [harness.component_of(c) for c in nbformat.read(path, as_version=4).cells
            if harness.component_of(c)]


@pytest.fixture(autouse=True)
def learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))
    return tmp_path / "learner"


def test_every_registered_component_has_a_tagged_stub_cell():
    """Lesson 06's CUDA stub too: an untagged stub is never played by the script."""
    assert {name for path in LESSONS for name in tagged(path)} == set(workbench.components())


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_the_learner_set_answers_every_stub_with_helpers_in_cells_of_their_own(path):
    notebook = nbformat.read(path, as_version=4)
    before = len(notebook.cells)
    answered = harness.answered_by_learner(notebook, path)
    assert set(tagged(path)) <= {harness.component_of(c) for c in notebook.cells
                                 if harness.component_of(c)}
    for cell in notebook.cells:
        if harness.component_of(cell):
            assert not harness.stubs_in(cell.source), cell.source  # no stub left to answer
    helpers = len(harness.learner_cells(path)) - len(answered)
    assert len(notebook.cells) == before + helpers  # each helper is a cell of its own
    assert helpers >= (path.stem != "06_kernel_phases")  # an answer leans on a cell above it


def test_the_reference_set_replaces_the_cuda_string_stub():
    source = ('SOFTMAX_PHASE = r"""  // phase 3\n  not_done();  // <- your code here\n"""\n\n'
              "ex.check_softmax_phase(SOFTMAX_PHASE)\n")
    typed = harness.typed_in(source, "softmax_phase_cuda")
    assert "not_done" not in typed and "__shfl_xor_sync" in typed
    assert typed.rstrip().endswith("ex.check_softmax_phase(SOFTMAX_PHASE)")
    namespace: dict = {}
    exec(compile(typed.split("\n", 1)[1].replace("ex.check_softmax_phase(SOFTMAX_PHASE)", ""),
                 "cell", "exec"), namespace)
    from minipaged.exercises.answers import lesson06

    assert namespace["SOFTMAX_PHASE"] == lesson06.SOFTMAX_PHASE


_cells = itertools.count()


def _learner_namespace(path: Path) -> dict:
    """The lesson's import cell, then the learner's cells, as IPython runs them."""
    namespace: dict = {"__name__": "__main__"}
    cells = [nbformat.read(path, as_version=4).cells[1].source] + harness.learner_cells(path)
    for source in cells:
        filename = f"/tmp/ipykernel_0/learner-{next(_cells)}.py"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), namespace)
    return namespace


SLOW_ALONE = {"06_kernel_phases", "16_capstone"}  # a CUDA-on-CPU build; an engine per case


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=[pytest.mark.slow]
                                               if p.stem in SLOW_ALONE else [])
                                  for p in LESSONS])
def test_each_learner_answer_and_its_saved_copy_pass_alone(path, learner_dir):
    namespace = _learner_namespace(path)
    for cell in nbformat.read(path, as_version=4).cells:
        name = harness.component_of(cell)
        if name is None:
            continue
        (stub,) = harness.stubs_in(cell.source)
        if name == "softmax_phase_cuda":  # C++ in a string: lesson 06 saves it itself
            assert namespace["ex"].check_softmax_phase(namespace[stub]).passed
            continue
        result = workbench.check_component(name, namespace[stub], num_cases=30)
        assert result.passed and "its saved copy passes them too" in result, result
        assert (learner_dir / f"{name}.py").exists()


@pytest.mark.slow
@pytest.mark.parametrize("answers", ["reference", "learner"])
def test_every_lesson_and_the_capstone_pass_with_the_answer_set(answers, tmp_path, capsys):
    code = harness.main(["--answers", answers, "--keep", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    for path in LESSONS:
        for name in tagged(path):
            assert f"✓ {name}:" in out, (name, out)
            assert (tmp_path / f"{name}.py").exists()
    assert "✓ capstone:" in out
