"""Lesson 15's reading of a decode sweep (minipaged/lab/sweep_reading.py): a plateau is claimed
only when the sweep measured one, and the roofline's sentence follows the ridge."""
import pytest
from hypothesis import given, strategies as st

from minipaged.lab.sweep_reading import sweep_reading

B = [1, 2, 4, 8, 16, 32]


def test_a_levelled_sweep_reads_as_a_plateau_from_its_knee():
    lines = sweep_reading(B, [10, 20, 40, 80, 85, 86], ridge_batch=16, ridge=4.0)
    assert lines[0].endswith("reached 90% of its best at B=8.")
    assert lines[1] == "tokens/s gained per doubling of B: x2.00, x2.00, x2.00, x1.06, x1.01"
    assert lines[2].startswith("plateau: from B=8 on") and "x1.01" in lines[2]
    assert "memory-bound below B=16" in lines[3] and "4.0 FLOP/B" in lines[3]


def test_a_sweep_still_growing_claims_no_plateau():
    lines = sweep_reading(B, [10, 20, 40, 80, 160, 320], ridge_batch=None, ridge=4.0)
    assert lines[2].startswith("no plateau in this sweep") and "x2.00" in lines[2]
    assert "memory-bound over the whole sweep (even B=32" in lines[3]


@given(st.lists(st.floats(1, 1e4), min_size=6, max_size=6))
def test_plateau_is_claimed_only_after_a_small_last_gain(tokens):
    lines = sweep_reading(B, tokens, ridge_batch=None, ridge=1.0)
    assert len(lines) == 4
    if lines[2].startswith("plateau"):
        assert tokens[-1] / tokens[-2] < 1.15


@pytest.mark.parametrize("sizes, tokens", [([1, 2], [1.0]), ([1], [1.0]), ([1, 2], [1.0, 0.0])])
def test_bad_sweeps_are_named(sizes, tokens):
    with pytest.raises(ValueError):
        sweep_reading(sizes, tokens, ridge_batch=None, ridge=1.0)
