"""Code exercises for the lessons: the learner writes a function the package has, a checker answers.

Each lesson module here (``lesson01`` ... ``lesson17``) has ``check_<name>(fn)`` functions. A
checker runs ``fn`` on randomized cases whose expected answer comes from the package itself
(the real ``BlockSpaceManager``, ``Scheduler``, ``prepare_inputs``, the server's
``TextStreamer``, the tensor-parallel layers, ...), and stops at the first case that disagrees,
with the inputs, both answers and a hint.

A learner's function starts as ``not_done()``. Calling it raises ``NotDone``, and the checker says
so plainly. When the environment variable ``MINIPAGED_SOLUTIONS=1`` is set (the headless lesson
tests set it), the checker uses the answer from ``minipaged.exercises.solutions`` instead, so the
lessons still run from top to bottom.
"""
from minipaged.exercises.checking import ExerciseFailed, NotDone, not_done, use_solutions

__all__ = ["ExerciseFailed", "NotDone", "not_done", "use_solutions"]
