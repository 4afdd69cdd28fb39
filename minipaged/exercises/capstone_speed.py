"""Lesson 16, the capstone's speed: the learner's engine's tokens/s against ``LLM()``'s on the same
workload, and the time each component spends in its own code.

A ``ComponentClock`` wraps what a run plugs in: a function is timed per call, a class becomes a
subclass whose own methods are timed (the methods the learner's class defines; the package's
class is timed on the same names). A component's time is its *own*: a call of another timed
component inside it is counted to that one, not twice. Both engines are timed the same way in the
same capstone run (``capstone._one_run``): ``LLM()``'s with the package's components wrapped at the
same places, the learner's with theirs. ``Speed.line()`` says the ratio and names the component
whose own time grew the most over the package's.

The times are of one run on whatever else the machine runs: a ratio near 1 says "as fast", not
more; the first step of each engine is left out (warm-up).
"""
from __future__ import annotations

import functools
import inspect
import time
import types
from collections import defaultdict
from dataclasses import dataclass, field

from minipaged.exercises import workbench


MODEL = "(the model)"  # not a component: the package's model, timed outside the components in it


class ComponentClock:
    """Seconds each component spent in its own code, and in ``step()`` calls in all, from the
    second step on: the first step of the first engine a process builds pays its warm-up (about
    20 times a later step's time on the tiny models), which would favour whichever runs second."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.steps = 0.0
        self.calls = 0  # step() calls, the first one included
        self.counting = False  # from the second step on
        self._inner: list[float] = []  # per active timed call: its nested timed calls' time

    def timed(self, name: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                if self.counting:
                    self.own[name] += spent - self._inner[-1]
                self._inner.pop()
                if self._inner:
                    self._inner[-1] += spent
        return call

    def step(self, engine):
        """One ``engine.step()``, timed from the second on (``run_steps``'s ``step``)."""
        self.calls += 1
        self.counting = self.calls > 1
        start = time.perf_counter()
        try:
            return engine.step()
        finally:
            if self.counting:
                self.steps += time.perf_counter() - start

    def watch_model(self, engine) -> None:
        """Time ``engine``'s model (the worker's ``execute_model``) as ``MODEL``: the same code in
        both engines, so that a step's own time is its own work, and the model's two times say
        how noisy the run was."""
        engine.worker.execute_model = self.timed(MODEL, engine.worker.execute_model)

    def wrap(self, name: str, obj, methods: tuple[str, ...] | None = None):
        """``obj`` timed as component ``name``: a class as a subclass with ``methods`` (default:
        the plain methods it defines itself) timed; a function per call; anything else (lesson
        06's C++ source) as it is."""
        if isinstance(obj, type):
            names = own_methods(obj) if methods is None else methods
            timed = {m: self.timed(name, inspect.getattr_static(obj, m)) for m in names
                     if isinstance(inspect.getattr_static(obj, m, None), types.FunctionType)}
            return type(obj.__name__, (obj,), {"__module__": obj.__module__,
                                               "__qualname__": obj.__qualname__, **timed})
        if callable(obj):
            return self.timed(name, obj)
        return obj


def own_methods(cls: type, package: type | None = None) -> tuple[str, ...]:
    """The plain methods ``cls`` defines, dunders aside but ``__call__``: in itself and in the classes it inherits
    from that ``package`` (the package's class) does not (the learner's own work)."""
    theirs = set(package.__mro__) if isinstance(package, type) else set(cls.__mro__[1:])
    names: dict[str, None] = {}
    for klass in cls.__mro__:
        if klass in theirs or klass is object:
            continue
        names.update((m, None) for m, v in vars(klass).items()
                     if isinstance(v, types.FunctionType)
                     and (m == "__call__" or not m.startswith("__")))
    return tuple(names)


def package_twins(learners: dict[str, object]) -> dict[str, object]:
    """The package's own object for each of the learner's components (its first slot now)."""
    return {name: workbench.component(name).package_object() for name in learners
            if isinstance(learners[name], type) or callable(learners[name])}


def timed_package(clock: ComponentClock, learners: dict[str, object]) -> dict[str, object]:
    """The package's twins wrapped by ``clock``, a class timed on the methods the learner's
    class defines (the same work in both engines)."""
    return {name: clock.wrap(name, obj, own_methods(learners[name], obj)
                             if isinstance(obj, type) and isinstance(learners[name], type)
                             else None)
            for name, obj in package_twins(learners).items()}


def timed_learners(clock: ComponentClock, learners: dict[str, object]) -> dict[str, object]:
    """The learner's components wrapped by ``clock``, a class timed on the methods it defines
    beyond the package's class (``own_methods``)."""
    twins = package_twins(learners)
    return {name: clock.wrap(name, obj, own_methods(obj, twins.get(name))
                             if isinstance(obj, type) else None)
            for name, obj in learners.items()}


@dataclass
class Speed:
    """Both engines' time over one run's workload."""

    tokens: int  # prompt and generated tokens the model ran after step 1 (equal in both)
    yours_s: float  # seconds in your engine's step() calls after the first
    package_s: float  # seconds in LLM()'s
    yours_own: dict = field(default_factory=dict)  # component -> seconds in its own code
    package_own: dict = field(default_factory=dict)

    def slowest(self) -> tuple[str, float, float] | None:
        """(component, your seconds, the package's) whose own time grew the most."""
        names = [n for n in self.yours_own if n != MODEL]
        if not names:
            return None
        name = max(names, key=lambda n: self.yours_own[n] - self.package_own.get(n, 0.0))
        return name, self.yours_own[name], self.package_own.get(name, 0.0)

    def line(self) -> str:
        if not self.tokens or self.yours_s <= 0 or self.package_s <= 0:
            return "speed: not measured (no tokens after the first step)"
        yours, theirs = self.tokens / self.yours_s, self.tokens / self.package_s
        text = (f"speed: your engine {yours:.0f} tokens/s, LLM()'s {theirs:.0f} tokens/s on the "
                f"same {self.tokens} tokens after step 1 ({yours / theirs:.2f}x LLM()'s throughput)")
        slowest = self.slowest()
        if slowest is not None:
            name, mine, package = slowest
            ratio = f", {mine / package:.1f}x" if package > 0 else ""
            text += (f"; your slowest component against the package's: {name} ({mine:.3f} s "
                     f"in its own code against {package:.3f} s{ratio})")
        mine, package = self.yours_own.get(MODEL, 0.0), self.package_own.get(MODEL, 0.0)
        if mine > 0 and package > 0:
            text += (f"; the model itself, the same code in both, took {mine / package:.2f}x "
                     f"its time in LLM(): how far this run's noise goes")
        return text
