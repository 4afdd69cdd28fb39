"""The lessons' tests: at the end of a session that ran lessons in JupyterLab, a table of each
lesson's Run All time and error cells (``test_lessons_in_jupyterlab.RUN_ALL``)."""
from __future__ import annotations

import sys


def run_all_table(rows) -> list[str]:
    """Lines of the table: lesson, seconds, error cells; then the total."""
    lines = [f"{'lesson':28} {'Run All (s)':>11}  error cells"]
    for name, seconds, errors in rows:
        lines.append(f"{name:28} {seconds:11.1f}  {', '.join(errors) or 'none'}")
    total = sum(seconds for _, seconds, _ in rows)
    failing = sum(bool(errors) for _, _, errors in rows)
    lines.append(f"{len(rows)} lessons, {total:.0f} s in all, {failing} with error cells")
    return lines


def pytest_terminal_summary(terminalreporter):
    module = sys.modules.get("test_lessons_in_jupyterlab")
    rows = getattr(module, "RUN_ALL", None)
    if rows:
        terminalreporter.section("Run All in JupyterLab, exercises unanswered")
        for line in run_all_table(rows):
            terminalreporter.write_line(line)
