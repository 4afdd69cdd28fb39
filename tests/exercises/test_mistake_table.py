"""scripts/mistake_table.py: the table of what each check says to each known mistake."""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from repo_paths import ROOT, load_script


def _script():
    return load_script("mistake_table")


def test_what_the_learner_reads_is_the_first_line_and_the_hint():
    said = _script().said
    message = "✗ Scheduler: case 3 fails\n  inputs: ...\n  yours: 1\n  hint: the newest group"
    assert said(message) == "✗ Scheduler: case 3 fails … hint: the newest group"
    assert said("✓ x: 200 cases") == "✓ x: 200 cases"
    assert said("a" * 300, width=20) == "a" * 19 + "…"


def test_every_slow_variant_of_the_cost_tests_is_in_the_table():
    import test_cost_checks
    import test_prefix_cache_design

    variants = _script().slow_variants()
    names = {slow.__name__ for _, slow in variants}
    assert {"LookupWalksTheCache", "SortsWhatIsLeftForEachGroup", "LeastRecentlyUsedAsAList",
            "OldestByTimestamp", "LookupScansTheCache", "TablesInAListOfPairs",
            "FreeTakesBlocksOffOneByOne"} <= names
    assert len(variants) >= 16
    assert test_cost_checks and test_prefix_cache_design


def test_the_script_finds_its_tests_outside_pytest():
    """Run as a script, it sets up the paths pytest's conftest sets (tests/helpers too)."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "mistake_table.py"),
                          "--list-variants"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "BlockSpaceManager TablesInAListOfPairs" in run.stdout.splitlines()


@pytest.mark.slow
def test_every_slow_variant_is_correct_so_only_its_cost_can_warn(tmp_path, monkeypatch):
    """A slow variant stands for a learner's correct but poorly built answer: its component's
    check must pass it (otherwise the cost test measures a wrong answer)."""
    from minipaged.exercises import workbench

    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))
    failed = []
    for name, slow in _script().slow_variants():
        with contextlib.redirect_stdout(io.StringIO()):
            result = workbench.check_component(name, slow, save=False)
        if result.status != "passed":
            failed.append((name, slow.__name__, str(result)[:200]))
    assert not failed, failed
