"""The build track: components the learner writes, checked, plugged into the engine, and kept.

A *component* is a class or function the package itself has (the free-list allocator, the block
manager, the scheduler's step, ``prepare_inputs``, the sampler, ...). In its lesson the learner
writes it from a stub that has the package's signature and docstring, and then::

    check_component("FreeListAllocator", MyAllocator)

runs the package's own properties against it (random workloads, the invariants the tests use)
and prints one message: a tick, "not done yet", or the first failing case with a hint. When it
passes, the source of the learner's code is saved under ``<cache root>/learner/<name>.py`` (see
``minipaged.cache_paths``), so that the capstone (lesson 16) can collect every component the
learner wrote, by name, without pasting. The saved file runs on its own: it also holds an
import for every name the code takes from a module, and the source of every function or class
it uses from the learner's other cells (``standalone.py``). The copy is then loaded back from the
file in a fresh namespace and checked again: a copy that fails is reported in the lesson, with
why, and is not a pass.

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
``NotDone`` when called, which the checker passes on. ``preamble`` is an import line the saved
file starts with (the lesson's names); the names the learner's code really uses are bound after
it, so that a helper of the learner's named like one of the lesson's wins, as in the notebook.
"""
from __future__ import annotations

import builtins
import collections
import contextlib
import datetime
import importlib
import json
import os
import random
import textwrap
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from minipaged.cache_paths import cache_root
from minipaged.exercises.checking import (SOLUTIONS_ENV, CheckResult, ExerciseFailed, NotDone,
                                          use_solutions)
from minipaged.exercises import cost
from minipaged.exercises.standalone import CannotSave, source_of, standalone_source

__all__ = ["CannotSave", "Component", "check_component", "collect", "component", "components",
           "forget", "learner_dir", "load_saved", "passed", "plugged_in", "register",
           "save_component", "saved_text", "source_of"]

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
_EXERCISE_MODULES = (tuple(f"minipaged.exercises.lesson{n:02d}" for n in range(1, 19))
                     + ("minipaged.exercises.lesson20_window",))


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
        result = CheckResult(str(wrong) + _shared_state_note(candidate), "failed")
    except Exception as crash:  # the learner's code raised: show where, in their code only
        result = CheckResult(f"✗ {name}: your code raised {type(crash).__name__}: {crash}\n"
                             f"{_learner_frames(crash)}{_shared_state_note(candidate)}",
                             "failed")
    else:
        if used_solution:
            result = CheckResult(f"{name}: not done yet, so the reference answer was used "
                                 f"({SOLUTIONS_ENV}=1); it passes {ran} random cases",
                                 "solution used")
        elif not save:
            _passed[name] = candidate
            result = CheckResult(f"✓ {name}: all {ran} random cases pass", "passed")
        else:
            result = _save_and_check_again(spec, candidate, ran, cases, seed)
    print(result)
    return result


_MUTABLE = (list, dict, set, bytearray, collections.deque)


def _shared_state_note(candidate) -> str:
    """A line for a failed class whose own class body (not the package's) holds a list, dict,
    set or deque: one object shared by every instance, a classic cause of a state that leaks
    from one pool or manager into the next."""
    if not isinstance(candidate, type):
        return ""
    shared = [(cls.__name__, attr, type(value).__name__)
              for cls in candidate.__mro__
              if getattr(builtins, cls.__name__, None) is not cls  # (object, dict, ...)
              and not cls.__module__.startswith("minipaged.")  # (the package's classes)
              for attr, value in vars(cls).items()
              if not attr.startswith("__") and isinstance(value, _MUTABLE)]
    if not shared:
        return ""
    owner, attr, kind = shared[0]
    return (f"\n  note: {attr} (a {kind}) is made once, in the class body of {owner}, so every "
            f"instance shares it (each pool or manager this check builds sees the others' "
            f"changes); if each instance needs its own, make it in __init__ (self.{attr} = ...)")


def _save_and_check_again(spec: Component, candidate, ran: int, cases: int,
                          seed: int | None) -> CheckResult:
    """Save a component that passed, load the saved copy back alone and check it again.

    The capstone runs the saved copy, not the notebook's object: a copy that does not run on its
    own (a name from another cell missing) must fail here, in its own lesson, with why.
    """
    name = spec.name
    yours = f"your {getattr(candidate, '__name__', name)}"
    try:
        text = saved_text(name, candidate)
    except CannotSave as why:
        return CheckResult(f"✗ {name}: {yours} passes all {ran} random cases, but it cannot be "
                           f"saved for the capstone: {why}", "failed")
    # The copy is checked where a failing one stays for the learner to read; a copy that
    # passes then replaces the saved component (an earlier saved one stays until then).
    staged = _write(learner_dir() / "failed" / f"{name}.py", text)
    problem = _check_copy(spec, staged, cases, seed)
    if problem is not None:
        return CheckResult(
            f"✗ {name}: {yours} passes, but its saved copy fails: {problem}\n"
            f"  The copy is what the capstone runs: your code, the lesson's imports it uses and "
            f"the functions and classes it calls from your other cells, in a namespace of its "
            f"own. Read it in {staged}; define what it misses in your cells, then run this "
            f"check again.", "failed")
    path = learner_dir() / f"{name}.py"
    staged.replace(path)
    with contextlib.suppress(OSError):
        staged.parent.rmdir()  # only when no other component's failed copy is left there
    _passed[name] = candidate
    cost_line = cost.check_and_record(name, candidate, learner_dir())  # (exercises/cost.py)
    return CheckResult(f"✓ {name}: all {ran} random cases pass; saved for the capstone in "
                       f"{path}, and its saved copy passes them too{cost_line}", "passed")


def _check_copy(spec: Component, path: Path, cases: int, seed: int | None) -> str | None:
    """None when the saved file at ``path`` loads alone and passes ``spec``'s check, else why."""
    try:
        copy = load_saved(path)
    except Exception as error:  # the learner's own code, run from the file
        return f"loading it raises {type(error).__name__}: {error}\n{_learner_frames(error)}"
    try:
        spec.check(copy, random.Random(seed), cases)
    except ExerciseFailed as wrong:
        return "its check says\n" + textwrap.indent(str(wrong), "    ")
    except NotDone:
        return ("it reaches a not_done(): a name in it is the lesson's stub in the copy, "
                "where your cells had your own")
    except Exception as error:
        return f"{type(error).__name__}: {error}\n{_learner_frames(error)}"
    return None


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


def saved_text(name: str, obj) -> str:
    """The file that keeps ``obj`` as component ``name``: a header, the component's preamble,
    then ``obj``'s source with the imports, helpers and values it uses (``standalone.py``).

    Raises:
        CannotSave: a name ``obj`` uses cannot be written into the file (the message says which).
    """
    spec = component(name)
    body = standalone_source(obj, spec.preamble)
    header = {"component": name, "lesson": spec.lesson, "object": obj.__name__,
              "saved": datetime.datetime.now().isoformat(timespec="seconds")}
    preamble = f"{spec.preamble}\n\n\n" if spec.preamble else ""
    return f"# minipaged build track: {json.dumps(header)}\n{preamble}{body}"


def save_component(name: str, obj) -> Path:
    """Write ``obj``, runnable on its own, to ``learner_dir()/<name>.py`` (not checked again:
    ``check_component`` does that).

    Args:
        name: the component's registered name.
        obj: the learner's function or class.

    Raises:
        CannotSave: ``obj`` or a name it uses cannot be saved.
    """
    return _write(learner_dir() / f"{name}.py", saved_text(name, obj))


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # never a half-written file for collect to read
    return path


def load_saved(path: Path):
    """Run a saved component's file in a namespace of its own; the object its header names.

    Args:
        path: a file ``save_component`` wrote.
    """
    text = Path(path).read_text()
    header = json.loads(text.splitlines()[0].split(":", 1)[1])
    namespace: dict[str, object] = {"__name__": f"learner_{header['component']}"}
    exec(compile(text, str(path), "exec"), namespace)  # the learner's own code
    if header["object"] not in namespace:
        raise NameError(f"the saved file defines no {header['object']!r}")
    return namespace[header["object"]]


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
        try:
            found[name] = load_saved(path)
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
