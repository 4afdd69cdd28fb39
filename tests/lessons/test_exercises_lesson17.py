"""Lesson 17's checkers: the answers pass; wrong predictions and wrong names fail at the first
wrong step or entry, with a hint about the idea and never the name itself."""
import pytest

from minipaged.exercises import lesson17 as ex
from minipaged.exercises import not_done, solutions

pytestmark = pytest.mark.lesson17


def test_the_answers_pass():
    assert ex.check_predict_v1_steps(solutions.predict_v1_steps).passed
    assert ex.check_v1_names(solutions.v1_names).passed


def test_unanswered_says_not_done():
    def unanswered():
        not_done()

    assert ex.check_predict_v1_steps(unanswered).status == "not done"
    assert ex.check_v1_names(unanswered).status == "not done"


def _steps_with(step, value):
    steps = solutions.predict_v1_steps()
    steps[step] = value
    return lambda: steps


@pytest.mark.parametrize("step, wrong, hint", [
    (0, {"a": 10}, "at most the token budget"),  # the whole prompt, past the budget
    (4, {"a": 1, "c": 5}, "admits no waiting request"),  # admitted in a step that preempted
    (5, {"b": 7}, "computed again"),  # the recompute forgets the sampled tokens
    (2, {"a": 1, "b": 1, "c": 5}, "blocks"),  # c admitted though the pool has 1 block left
])
def test_a_wrong_prediction_fails_at_its_step_with_the_idea(step, wrong, hint):
    result = ex.check_predict_v1_steps(_steps_with(step, wrong))
    assert result.status == "failed"
    assert f"case {step + 1} fails" in result and hint in result


def test_a_prediction_that_stops_early_fails():
    result = ex.check_predict_v1_steps(lambda: solutions.predict_v1_steps()[:-1])
    assert result.status == "failed" and "(no step)" in result


def test_a_wrong_name_fails_without_giving_the_answer():
    names = solutions.v1_names()
    names["FreeListAllocator"] = "KVCacheManager"
    result = ex.check_v1_names(lambda: names)
    assert result.status == "failed" and "FreeListAllocator" in result
    assert "block_pool.py" in result and "BlockPool" not in result.replace("block_pool", "")


def test_swapping_has_no_v1_name():
    names = solutions.v1_names()
    names["blocks_to_swap_out"] = "blocks_to_swap_out"
    result = ex.check_v1_names(lambda: names)
    assert result.status == "failed" and "CPU" in result
