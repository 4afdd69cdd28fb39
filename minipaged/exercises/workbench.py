"""The build track: components the learner writes, checked, plugged into the engine, and kept.

A *component* is a class or function the package itself has (the free-list allocator, the block
manager, the scheduler's step, ``prepare_inputs``, the sampler, ...). In its lesson the learner
writes it from a stub that has the package's signature and docstring, and then::

    check_component("FreeListAllocator", MyAllocator)

runs the package's own properties against it (random workloads, the invariants the tests use)
and prints one message: a tick, "not done yet", or the first failing case with a hint. When it
passes, the source of the learner's code is saved under ``<cache root>/learner/<name>.py`` (see
``minipaged.cache_paths``), so that the capstone (lesson 16) can collect every component the
learner wrote, by name, without pasting.

``plugged_in(...)`` puts components into the real engine for the rest of a lesson: each
component names the places (``module:attribute``) where the package looks it up, and inside the
``with`` block those names point at the learner's code. Only a component that passed its check
is plugged in; for one that did not, the package's own runs and the cell says so.

Registering a component (each ``minipaged/exercises/lessonNN.py`` does this for its own)::

    register(Component(
        name="FreeListAllocator", lesson="02",
        slots=("minipaged.core.block_manager:FreeListAllocator",),
        check=_check_free_list_allocator,      # (candidate, rng, num_cases) -> cases run
        solution="minipaged.exercises.solutions_build:FreeListAllocator",
        preamble="from minipaged.exercises.lesson02 import *",
    ))

``check`` calls ``checking.fail(...)`` at the first case that disagrees (never an ``assert``: the
checker's own source must not show in the learner's traceback); an unanswered stub raises
``NotDone`` when called, which the checker passes on. ``preamble`` is the import line the saved
source needs to run again on its own (the stub's base class, ``not_done``, ...).
"""
from __future__ import annotations

import ast
import contextlib
import datetime
import importlib
import inspect
import json
import linecache
import os
import random
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from minipaged.cache_paths import cache_root
from minipaged.exercises.checking import (SOLUTIONS_ENV, CheckResult, ExerciseFailed, NotDone,
                                          use_solutions)

LEARNER_DIR_VARIABLE = "MINIPAGED_LEARNER_DIR"


@dataclass(frozen=True)
class Component:
    """One component of the build track (see the module's docstring)."""

    name: str
    lesson: str
    slots: tuple[str, ...]
    check: Callable[[object, random.Random, int], int]
    solution: str
    preamble: str = ""
    num_cases: int = 200

    def package_object(self):
        """What the package itself has at the first slot."""
        return _resolve(self.slots[0])

    def solution_object(self):
        return _resolve(self.solution)


_registry: dict[str, Component] = {}
# name -> the learner's object that passed its check most recently in this process
_passed: dict[str, object] = {}


def register(component: Component) -> Component:
    _registry[component.name] = component
    return component


def components() -> dict[str, Component]:
    """Every registered component, importing the lessons' exercise modules that register them."""
    for module in _EXERCISE_MODULES:
        importlib.import_module(module)
    return dict(_registry)


def component(name: str) -> Component:
    known = components()
    if name not in known:
        raise KeyError(f"no component named {name!r}; the build track has: "
                       f"{', '.join(sorted(known))}")
    return known[name]


# the modules that register components (imported lazily: each imports torch and the package)
_EXERCISE_MODULES = tuple(f"minipaged.exercises.lesson{n:02d}" for n in range(1, 19))


def _resolve(path: str):
    module, _, attribute = path.partition(":")
    target = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


# -- checking -----------------------------------------------------------------------------------
def check_component(name: str, candidate, num_cases: int | None = None,
                    seed: int | None = 0, save: bool = True) -> CheckResult:
    """Run component ``name``'s checks on ``candidate``; print and return one message.

    Passing saves ``candidate``'s source for the capstone (``save=False`` does not). With
    ``MINIPAGED_SOLUTIONS=1`` an unanswered stub is replaced by the reference answer, which is
    then checked the same way (and never saved as the learner's).
    """
    spec = component(name)
    cases = num_cases or spec.num_cases
    _passed.pop(name, None)  # a new check: an earlier pass no longer counts
    used_solution = False
    try:
        try:
            ran = spec.check(candidate, random.Random(seed), cases)
        except NotDone:
            if not use_solutions():
                raise
            used_solution = True
            ran = spec.check(spec.solution_object(), random.Random(seed), cases)
    except NotDone:
        result = CheckResult(
            f"… {name}: not done yet. Write your code in place of not_done(), then run its "
            f"cell again (the check runs with it).", "not done")
    except ExerciseFailed as wrong:
        result = CheckResult(str(wrong), "failed")
    except Exception as crash:  # the learner's code raised: show where, in their code only
        result = CheckResult(f"✗ {name}: your code raised {type(crash).__name__}: {crash}\n"
                             f"{_learner_frames(crash)}", "failed")
    else:
        if used_solution:
            result = CheckResult(f"{name}: not done yet, so the reference answer was used "
                                 f"({SOLUTIONS_ENV}=1); it passes {ran} random cases",
                                 "solution used")
        else:
            _passed[name] = candidate
            where = ""
            if save:
                path = save_component(name, candidate)
                where = f"; saved for the capstone in {path}" if path else ""
            result = CheckResult(f"✓ {name}: all {ran} random cases pass{where}", "passed")
    print(result)
    return result


def _learner_frames(error: BaseException) -> str:
    """The traceback's frames that are not minipaged's own (the learner's cells)."""
    package = str(Path(__file__).resolve().parents[1])
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(package)]
    return "".join(traceback.format_list(frames[-3:])).rstrip()


def passed(name: str):
    """The learner's object that passed ``name``'s check in this process, or None."""
    return _passed.get(name)


# -- plugging into the engine -------------------------------------------------------------------
@contextlib.contextmanager
def plugged_in(*names: str, objects: dict[str, object] | None = None,
               quiet: bool = False) -> Iterator[dict[str, object]]:
    """Inside the block, the package looks up the learner's components instead of its own.

    ``names``: components whose learner's version passed its check in this process (those that
    did not keep the package's, and a line says so). ``objects``: explicit name -> object (the
    capstone's collected components). Yields name -> what is plugged in.
    """
    chosen: dict[str, object] = dict(objects or {})
    for name in names:
        if name in chosen:
            continue
        mine = _passed.get(name)
        if mine is not None:
            chosen[name] = mine
            if not quiet:
                print(f"✓ your {name} is plugged into the engine")
        elif not quiet:
            print(f"(your {name} has not passed its check yet, so the package's own runs here; "
                  f"once it passes, run this cell again to use yours)")
    saved: list[tuple[object, str, object]] = []
    try:
        for name, obj in chosen.items():
            for slot in component(name).slots:
                module_name, _, attribute = slot.partition(":")
                *owner_path, leaf = attribute.split(".")
                owner = importlib.import_module(module_name)
                for part in owner_path:
                    owner = getattr(owner, part)
                saved.append((owner, leaf, owner.__dict__.get(leaf, _MISSING)
                              if isinstance(owner, type) else getattr(owner, leaf)))
                setattr(owner, leaf, obj)
        yield chosen
    finally:
        for owner, leaf, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, leaf)
            else:
                setattr(owner, leaf, old)


_MISSING = object()


# -- saving and collecting ------------------------------------------------------------------------
def learner_dir() -> Path:
    """Where the learner's components are kept: ``$MINIPAGED_LEARNER_DIR`` or the cache root's
    ``learner/``."""
    return Path(os.environ.get(LEARNER_DIR_VARIABLE) or cache_root() / "learner")


def source_of(obj) -> str:
    """The source of a class or function, also when it was defined in a notebook cell."""
    target = obj.__func__ if inspect.ismethod(obj) else obj
    if inspect.isfunction(target):
        return inspect.getsource(target)
    code_objects = [member.__code__ for member in vars(target).values()
                    if inspect.isfunction(member)]
    if not code_objects:
        return inspect.getsource(target)
    filename = code_objects[0].co_filename
    text = "".join(linecache.getlines(filename))
    if not text:
        return inspect.getsource(target)
    first = min(code.co_firstlineno for code in code_objects)
    best = None
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.ClassDef) and node.name == target.__name__
                and node.lineno <= first <= (node.end_lineno or first)):
            if best is None or node.lineno > best.lineno:
                best = node
    if best is None:
        return inspect.getsource(target)
    start = min([best.lineno] + [d.lineno for d in best.decorator_list])
    return "".join(text.splitlines(keepends=True)[start - 1:best.end_lineno])


def save_component(name: str, obj) -> Path | None:
    """Write ``obj``'s source, runnable on its own, to ``learner_dir()/<name>.py``."""
    try:
        source = source_of(obj)
    except (OSError, TypeError):
        return None  # no source to keep (built in C, or made by exec): nothing saved
    spec = component(name)
    header = {"component": name, "lesson": spec.lesson, "object": obj.__name__,
              "saved": datetime.datetime.now().isoformat(timespec="seconds")}
    folder = learner_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    text = (f"# minipaged build track: {json.dumps(header)}\n"
            f"{spec.preamble}\n\n{inspect.cleandoc(source) if source.startswith(' ') else source}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


class MissingComponents(LookupError):
    """The capstone asked for components the learner has not written (or not passed) yet."""


def collect(names: list[str] | tuple[str, ...]) -> tuple[dict[str, object], list[str]]:
    """The learner's saved components by name, and the names with nothing saved.

    Each saved file runs in a namespace of its own; the object named in its header is taken.
    A file that no longer runs is reported as missing, with the reason.
    """
    found: dict[str, object] = {}
    missing: list[str] = []
    for name in names:
        path = learner_dir() / f"{name}.py"
        if not path.exists():
            missing.append(name)
            continue
        text = path.read_text()
        header = json.loads(text.splitlines()[0].split(":", 1)[1])
        namespace: dict[str, object] = {"__name__": f"learner_{name}"}
        try:
            exec(compile(text, str(path), "exec"), namespace)  # the learner's own code
            found[name] = namespace[header["object"]]
        except Exception as error:
            missing.append(f"{name} (its saved file {path} fails: {type(error).__name__}: "
                           f"{error})")
    return found, missing


def forget(names: list[str] | tuple[str, ...] | None = None) -> None:
    """Delete saved components (all when ``names`` is None): start the build track over."""
    folder = learner_dir()
    if not folder.exists():
        return
    for path in folder.glob("*.py"):
        if names is None or path.stem in names:
            path.unlink()
