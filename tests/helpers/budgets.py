"""How many examples a Hypothesis test draws: its full budget in ``make test-all``, a few in the
fast tier (``make test`` sets MINIPAGED_FAST_TESTS=1).

A test with its own budget writes ``max_examples=examples(40)``; a test without one gets the
"fast" profile that tests/conftest.py loads. The fast tier still runs every property, on fewer
random cases: a smoke test of the invariant, while ``make test-all`` is the search for a bug.
"""
import os

FAST = os.environ.get("MINIPAGED_FAST_TESTS", "") not in ("", "0")
FAST_EXAMPLES = 5  # per property in the fast tier


def examples(full: int) -> int:
    """The number of examples to draw in this tier.

    Args:
        full: the test's budget in the full tier (``make test-all``).
    """
    return min(full, FAST_EXAMPLES) if FAST else full


def load_profile() -> None:
    """Cap the default budget (Hypothesis draws 100) in the fast tier; the full tier keeps it."""
    try:
        from hypothesis import settings
    except ImportError:  # NOTE: a GPU machine's own python3 may lack it; tests/gpu draws nothing
        return
    settings.register_profile("fast", max_examples=FAST_EXAMPLES)
    if FAST:
        settings.load_profile("fast")
