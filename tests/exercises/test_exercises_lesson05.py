"""Lesson 05's load-count checker: it passes the solution, fails plausible wrong answers in a few
lines with a hint that does not state the code, and says "not done yet" when unanswered. (The
other lesson-05 checkers are in tests/exercises/test_exercises.py.)"""
import ast
import inspect

import pytest

from minipaged.exercises import lesson05, not_done
from minipaged.exercises import solutions as S

pytestmark = pytest.mark.lesson05


def loads_rounding_down(head_size, block_size, x, shared):
    group = max(32 // block_size, 1)
    return (head_size // x, 16 // group) if shared else (head_size // x // group, 16)


def loads_of_the_whole_group(head_size, block_size, x, shared):
    group = max(32 // block_size, 1)
    return (head_size // x // group, 16 // group) if shared else (-(-head_size // x // group), 16)


def test_checker_passes_the_solution(monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    for seed in (0, 1, 2):
        result = lesson05.check_key_loads(S.key_loads, seed=seed)
        assert result.passed and "✓" in result


@pytest.mark.parametrize("wrong", [loads_rounding_down, loads_of_the_whole_group])
def test_checker_fails_wrong_answers_in_a_few_lines(wrong, capsys):
    capsys.readouterr()
    result = lesson05.check_key_loads(wrong)
    assert result.status == "failed" and not result.passed
    message = str(result)
    assert "case" in message and "hint:" in message and "expected:" in message
    assert len(message.splitlines()) <= 6
    assert capsys.readouterr().out == message + "\n"


def test_checker_says_not_done_yet(monkeypatch):
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)

    def unanswered(*args):
        not_done()

    result = lesson05.check_key_loads(unanswered)
    assert result.status == "not done" and "not done yet" in result


def test_the_hints_do_not_state_the_code():
    code = ["//", " % ", "ceil(", "range(", "16 / G"]
    source = inspect.getsource(lesson05.check_key_loads)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "hint"
                                                for t in node.targets):
            hint = "".join(part.value for part in ast.walk(node.value)
                           if isinstance(part, ast.Constant) and isinstance(part.value, str))
            assert not [c for c in code if c in hint], hint
