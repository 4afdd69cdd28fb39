"""A lesson's code cell run on its own, without a kernel: what it displays, for the tests that check
a lesson's pictures and printouts say what its text says."""
import json

from repo_paths import ROOT


def cell_source(lesson: str, needle: str) -> str:
    cells = json.loads((ROOT / "lessons" / f"{lesson}.ipynb").read_text())["cells"]
    hits = ["".join(c["source"]) for c in cells if needle in "".join(c["source"])]
    assert len(hits) == 1, (needle, len(hits))
    return hits[0]


def run_cell(lesson: str, needle: str, namespace: dict) -> list:
    """Run the code cell of ``lesson`` that contains ``needle``; returns what it displayed."""
    shown = []
    namespace.setdefault("display", shown.append)
    exec(compile(cell_source(lesson, needle), lesson, "exec"), namespace)
    return shown
