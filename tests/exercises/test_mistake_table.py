"""scripts/mistake_table.py: the table of what each check says to each known mistake."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("mistake_table",
                                                  ROOT / "scripts" / "mistake_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
            "OldestByTimestamp", "LookupScansTheCache"} <= names
    assert len(variants) >= 14
    assert test_cost_checks and test_prefix_cache_design
