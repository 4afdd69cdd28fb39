"""Lesson 20's build-track component, ``blocks_out_of_window``: answers written as a learner
writes them pass (random cases, then the tiny Gemma 3 with KV cache groups in the engine, tokens
and every group's tables against the package's run); the realistic mistakes fail with a hint
naming the cause; the package's sliding managers call the one function."""
from __future__ import annotations

import pytest

from minipaged.core import sliding_window
from minipaged.exercises import lesson20_window as ex, not_done, workbench
from minipaged.exercises.answers import lesson20 as answers

pytestmark = pytest.mark.lesson20
NAME = "blocks_out_of_window"


@pytest.fixture(autouse=True)
def _learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))


def is_behind(index, size, first_read):
    return (index + 1) * size <= first_read


def learner_loop(num_tokens, window, block_size, block_table):
    """A for loop with break and continue, a helper, other names."""
    result = []
    for pos, blk in enumerate(block_table):
        if pos == len(block_table) - 1:
            break
        if blk == -1:
            continue
        if is_behind(pos, block_size, num_tokens - window):
            result.append(pos)
    return result


def learner_slices(num_tokens, window, block_size, block_table):
    """Counts the blocks wholly before the window, then filters the dropped ones."""
    before = max(num_tokens - window, 0) // block_size
    candidates = range(len(block_table))[:before][:len(block_table) - 1]
    return [j for j in candidates if block_table[j] != sliding_window.DROPPED_NUMBER]


def returns_block_numbers(num_tokens, window, block_size, block_table):
    return [block_table[i] for i in answers.blocks_out_of_window(num_tokens, window, block_size,
                                                                  block_table)]


@pytest.mark.parametrize("fn", [answers.blocks_out_of_window, learner_loop, learner_slices],
                         ids=["reference", "loop_and_helper", "slices"])
def test_right_answers_pass_and_are_saved(fn):
    result = workbench.check_component(NAME, fn)
    assert result.passed, result
    assert "its saved copy passes them too" in result


def test_the_engine_comparison_says_what_it_compared():
    said = ex.check_in_the_engine(learner_loop)
    assert "tokens and every group's block tables" in said and "steps" in said


def test_the_package_managers_call_the_one_function():
    """Plugged in place of the package's function, one that frees nothing keeps the sliding
    groups' blocks (only a long prompt's entries before its last window stay dropped): the
    hybrid manager's sliding groups call it."""
    def dropped(steps):
        return sum(table.count(-1) for step in steps for tables in step.values()
                   for table in tables[1:])

    assert dropped(ex.engine_run(lambda n, w, b, table: [])[1]) < dropped(ex.engine_run()[1])


@pytest.mark.parametrize("fn,words", [
    (returns_block_numbers, "blocks' numbers: return their indices"),
])
def test_mistakes_fail_with_a_hint_naming_the_cause(fn, words):
    result = workbench.check_component(NAME, fn, save=False)
    assert result.status == "failed"
    assert words in result.split("hint: ", 1)[1], result


def test_a_mistake_only_the_engine_shows_is_caught():
    """Right on every random case, wrong in the engine: it stops giving blocks back after 40
    calls (a stand-in for state kept between calls)."""
    calls = []

    def tires(num_tokens, window, block_size, block_table):
        calls.append(1)
        if len(calls) > 40:
            return []
        return answers.blocks_out_of_window(num_tokens, window, block_size, block_table)

    result = workbench.check_component(NAME, tires, num_cases=40, save=False)
    assert result.status == "failed" and "the engine on a tiny Gemma 3" in result, result


def test_unanswered_says_not_done_and_solutions_fill_in(monkeypatch):
    def unanswered(num_tokens, window, block_size, block_table):
        not_done()

    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    assert workbench.check_component(NAME, unanswered).status == "not done"
    monkeypatch.setenv("MINIPAGED_SOLUTIONS", "1")
    assert workbench.check_component(NAME, unanswered).status == "solution used"
