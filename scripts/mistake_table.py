"""What each check of the build track says to each known mistake: the table the course is judged
by (a tick is a promise; a hint names the cause).

Every mutant of ``tests/exercises/test_mutants.py`` (one-line mistakes of the reference answers,
the learners' mistakes among them) runs through its component's check; every slow-but-correct
variant of ``tests/exercises/test_cost_checks.py``, ``test_block_manager_design.py`` and
``test_prefix_cache_design.py`` runs through its component's check and then its cost probe. One
row each: the component, the mistake, the verdict (rejected, or passed with a cost warning) and
the first lines of what the learner reads.

    python scripts/mistake_table.py                 # the mutants (about two minutes)
    python scripts/mistake_table.py --slow          # and the slow variants (several minutes)
    python scripts/mistake_table.py --markdown      # as a markdown table
    python scripts/mistake_table.py --list-variants # the slow variants' names only
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "exercises"
HELPERS = ROOT / "tests" / "helpers"  # (what the tests import, as pytest's conftest puts it)


def said(message: str, width: int = 150) -> str:
    """The learner's first line and the hint (or the cost line), on one line."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    hint = next((line for line in lines if line.startswith("hint:") or line.startswith("⚠")), "")
    text = first if not hint or hint == first else f"{first} … {hint}"
    return text if len(text) <= width else text[:width - 1] + "…"


def mutant_rows():
    """(component, mistake, verdict, what the learner reads) for each mutant."""
    from minipaged.exercises import workbench
    import test_mutants

    for name, what, mutant in test_mutants.MUTANTS:
        with contextlib.redirect_stdout(io.StringIO()):  # (the check prints what it returns)
            result = workbench.check_component(name, mutant, save=False)
        verdict = "rejected" if result.status == "failed" else f"NOT REJECTED ({result.status})"
        yield name, what, verdict, said(result)


def slow_variants() -> list:
    """(component, slow-but-correct variant) pairs of the cost tests."""
    import test_cost_checks
    import test_block_manager_design as tables
    import test_prefix_cache_design as design

    variants = []
    for mark in test_cost_checks.test_a_cost_that_grows_with_the_pool_gets_a_verdict_naming_the_operation.pytestmark:  # noqa: E501
        if mark.name == "parametrize":
            variants += [getattr(p, "values", p)[:2] for p in mark.args[1]]
    variants += [("BlockSpaceManager", tables.TablesInAListOfPairs),
                 ("BlockSpaceManager", tables.FreeTakesBlocksOffOneByOne),
                 ("PrefixCachingAllocator", design.LeastRecentlyUsedAsAList),
                 ("PrefixCachingAllocator", design.OldestByTimestamp),
                 ("PrefixCachingAllocator", design.LookupScansTheCache)]
    return variants


def slow_variant_rows():
    """(component, slow variant, verdict, what the learner reads) for each slow variant."""
    from minipaged.exercises import workbench
    from minipaged.exercises.cost import measure_cost

    for name, slow in slow_variants():
        with contextlib.redirect_stdout(io.StringIO()):
            result = workbench.check_component(name, slow, save=False)
        if result.status != "passed":
            yield name, slow.__name__, f"check: {result.status}", said(result)
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            verdict = measure_cost(name, slow)
        warned = verdict is not None and verdict.slow
        yield (name, slow.__name__, "passed, warned" if warned else "passed, NO WARNING",
               said(verdict.message() if verdict is not None else "no probe"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow", action="store_true", help="also the slow-but-correct variants")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--list-variants", action="store_true",
                        help="only name the slow variants (nothing is run)")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(TESTS), str(HELPERS)]
    if args.list_variants:
        for name, slow in slow_variants():
            print(f"{name} {slow.__name__}")
        return 0
    os.environ.setdefault("MINIPAGED_LEARNER_DIR", tempfile.mkdtemp(prefix="mistakes-"))
    started = time.perf_counter()
    rows = list(mutant_rows())
    if args.slow:
        rows += list(slow_variant_rows())
    if args.markdown:
        print("| component | mistake | verdict | what the learner reads |")
        print("|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    else:
        for name, what, verdict, text in rows:
            print(f"{name:24} {what[:48]:48} {verdict:18} {text}")
    missed = [row for row in rows if "NOT" in row[2] or "NO WARNING" in row[2]]
    print(f"\n{len(rows)} rows, {len(missed)} not caught, in {time.perf_counter() - started:.0f} s")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
