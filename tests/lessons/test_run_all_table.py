"""The table of Run All times that ends a session which ran the lessons in JupyterLab."""
import importlib.util
from pathlib import Path


def _conftest():
    spec = importlib.util.spec_from_file_location("lessons_conftest",
                                                  Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_lists_each_lesson_its_time_and_its_error_cells():
    lines = _conftest().run_all_table([("01_kv_cache", 12.34, []),
                                       ("02_blocks", 20.0, ["cell 3: ValueError"])])
    assert lines[1].split() == ["01_kv_cache", "12.3", "none"]
    assert lines[2].endswith("cell 3: ValueError")
    assert lines[-1] == "2 lessons, 32 s in all, 1 with error cells"
