"""The machinery every checker shares: not-done detection, solution fill-in, the one message.

A checker never raises for an unanswered or a wrong answer: it prints one short message (a tick,
"not done yet", or the failing case with yours, the expected answer and a hint) and returns it,
so that Run All goes on. The cells after an exercise call the learner's function only once its
check has passed (``usable``); until then they use the package's own.
"""
from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable

SOLUTIONS_ENV = "MINIPAGED_SOLUTIONS"

# exercise name -> the learner's function that passed its check most recently
_passed: dict[str, Callable] = {}


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


class CheckResult(str):
    """What a checker printed; ``status`` is "passed", "failed", "not done" or "solution used".

    It is printed once by the checker, so Jupyter shows nothing more for it as a cell's value.
    """

    status: str

    def __new__(cls, message: str, status: str) -> "CheckResult":
        result = super().__new__(cls, message)
        result.status = status
        return result

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def _ipython_display_(self) -> None:
        """Already printed: a cell ending in a check shows its message once."""


class Learner:
    """Calls the learner's function; swaps in the solution if it is not done and that is allowed."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name = name
        self.fn = fn
        self.used_solution = False
        _passed.pop(name, None)  # a new check: an earlier pass no longer counts

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except NotDone:
            if self.used_solution or not use_solutions():
                raise NotDone(self.name) from None
        from minipaged.exercises import solutions

        self.fn = getattr(solutions, self.name)
        self.used_solution = True
        return self.fn(*args, **kwargs)


def fail(name: str, case: int, inputs: str, got, expected, hint: str) -> None:
    """Stop the check at this case (the checker turns it into the printed message)."""
    raise ExerciseFailed(f"✗ {name}: case {case} fails\n  inputs:   {inputs}\n"
                         f"  yours:    {got!r}\n  expected: {expected!r}\n  hint: {hint}")


def fail_if_changed(name: str, case: int, inputs: str, given: tuple, kept: tuple,
                    names: tuple, how: str, why: str) -> None:
    """Fail when the learner's function changed one of the lists or tensors it was ``given``
    (``kept`` holds untouched copies, ``names`` their parameters): ``how`` such a change is
    made, ``why`` the engine needs them unchanged."""
    for after, before, what in zip(given, kept, names):
        if before is None:
            same = after is None
        elif hasattr(before, "equal"):  # a tensor (torch is not imported here)
            same = before.equal(after)
        else:
            same = after == before
        if not same:
            fail(name, case, inputs, f"{what} changed by your call", f"{what} as given",
                 f"your function changed the {what} it was given ({how}): {why}")


def passed(learner: Learner, num_cases: int) -> CheckResult:
    if learner.used_solution:
        return CheckResult(f"{learner.name}: not done yet, so the solution was used "
                           f"({SOLUTIONS_ENV}=1); it passes {num_cases} random cases",
                           "solution used")
    _passed[learner.name] = learner.fn
    return CheckResult(f"✓ {learner.name}: all {num_cases} random cases pass", "passed")


def exercise(check: Callable[..., CheckResult]) -> Callable[..., CheckResult]:
    """A checker that prints its one message and returns it instead of raising."""

    @functools.wraps(check)
    def run(fn: Callable, *args, **kwargs) -> CheckResult:
        try:
            result = check(fn, *args, **kwargs)
        except NotDone as unanswered:
            result = CheckResult(
                f"… {unanswered.args[0]}: not done yet. Write your code in place of "
                f"not_done(), then run its cell again (the check runs with it).", "not done")
        except ExerciseFailed as wrong:
            result = CheckResult(str(wrong), "failed")
        print(result)
        return result

    return run


def usable(name: str, fn: Callable, package_fn: Callable) -> Callable:
    """``fn`` if it passed its check, else the package's ``package_fn``; says which, in a line."""
    if _passed.get(name) is fn:
        print(f"✓ your {name} is used from here on")
        return fn
    print(f"(your {name} has not passed its check yet, so the package's own is used here; once "
          f"it passes, run this cell and the ones after it again to use yours)")
    return package_fn


def rng_for(seed: int | None) -> random.Random:
    return random.Random(seed)
