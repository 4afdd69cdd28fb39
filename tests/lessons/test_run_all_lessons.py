"""scripts/run_all_lessons.py on a tiny notebook: the error cells it finds, its table, and that
a run leaves no file behind (the lessons run from a temporary copy)."""
import pytest

from repo_paths import load_script


def _script():
    return load_script("run_all_lessons")


def test_the_table_lists_each_lessons_seconds_and_error_cells_then_the_total():
    text = _script().table([("01_a", 1.25, []), ("02_longer_name", 3.0, [(2, "KeyError"),
                                                                        (5, "ValueError")])])
    lines = text.splitlines()
    assert lines[0].split() == ["lesson", "seconds", "error", "cells"]
    assert lines[2].split() == ["01_a", "1.2", "-"]  # 1.25 printed to one decimal
    assert lines[3].split() == ["02_longer_name", "3.0", "2", "KeyError,", "5", "ValueError"]
    assert lines[4].split()[:2] == ["total", "4.2"]
    assert "2 error cell(s) in 1 of 2 lesson(s)" in lines[4]


def test_a_tiny_notebook_runs_unanswered_from_a_copy_and_its_error_cells_are_found(tmp_path,
                                                                                  monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")  # must not reach the kernel
    cells = [nbformat.v4.new_markdown_cell("# tiny"),
             nbformat.v4.new_code_cell("import os\nopen('left.txt', 'w').write('x')"),
             nbformat.v4.new_code_cell("assert 'MINIPAGED_SOLUTIONS' not in os.environ"),
             nbformat.v4.new_code_cell("{}['missing']"),
             nbformat.v4.new_code_cell("print('after the error')")]
    path = tmp_path / "00_tiny.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    script = _script()
    notebook, seconds = script.execute_unanswered(path, timeout=120)
    assert script.error_cells(notebook) == [(3, "KeyError")]
    assert "after the error" in notebook.cells[4].outputs[0]["text"]  # later cells still run
    assert seconds > 0 and sorted(p.name for p in tmp_path.iterdir()) == ["00_tiny.ipynb"]
    assert not nbformat.read(path, as_version=4).cells[1].get("outputs")  # the lesson unchanged


def test_main_refuses_a_missing_notebook(capsys):
    with pytest.raises(SystemExit):
        _script().main(["lessons/99_none.ipynb"])
    assert "no such notebook" in capsys.readouterr().err
