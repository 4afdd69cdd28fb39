"""The machinery every checker shares: not-done detection, solution fill-in, failure messages."""
from __future__ import annotations

import os
import random
from collections.abc import Callable

SOLUTIONS_ENV = "MINIPAGED_SOLUTIONS"


class NotDone(NotImplementedError):
    """An exercise cell still says ``not_done()``."""


class ExerciseFailed(AssertionError):
    """The learner's function disagreed with the package on some case."""


def not_done() -> None:
    """Put this where your code goes; the checker will tell you the exercise is not done yet."""
    raise NotDone("not done yet: replace not_done() with your code")


def use_solutions() -> bool:
    """True when the checkers may fill in unanswered exercises (headless lesson runs)."""
    return os.environ.get(SOLUTIONS_ENV, "") == "1"


class Learner:
    """Calls the learner's function; swaps in the solution if it is not done and that is allowed."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name = name
        self.fn = fn
        self.used_solution = False

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except NotDone:
            if self.used_solution or not use_solutions():
                raise NotDone(f"{self.name} is not done yet: replace not_done() in its cell "
                              f"with your code, run that cell, then run this check again") \
                    from None
        from minipaged.exercises import solutions

        self.fn = getattr(solutions, self.name)
        self.used_solution = True
        return self.fn(*args, **kwargs)


def fail(name: str, case: int, inputs: str, got, expected, hint: str) -> None:
    raise ExerciseFailed(f"{name}: case {case} fails\n  inputs:   {inputs}\n"
                         f"  yours:    {got!r}\n  expected: {expected!r}\n  hint: {hint}")


def passed(learner: Learner, num_cases: int) -> str:
    if learner.used_solution:
        message = (f"{learner.name}: not done yet, so the solution was used "
                   f"({SOLUTIONS_ENV}=1); it passes {num_cases} random cases")
    else:
        message = f"✓ {learner.name}: all {num_cases} random cases pass"
    print(message)
    return message


def rng_for(seed: int | None) -> random.Random:
    return random.Random(seed)
