"""The learner's engine, served: ``minipaged serve --learner`` (lesson 16), and in-process as
``LLM(learner=True)``.

The engine is built as the capstone builds it: the package's ``LLMEngine`` with every component
the learner saved plugged into its slots (``workbench.collect``, ``workbench.plugged_in``); the
components with nothing saved, or whose saved file no longer loads, stay the package's, and
``what_runs`` names each of them. The server, its live page and its limits are the usual ones.

A learner's component that raises while serving is named: the exception becomes a
``LearnerComponentError`` ("your Scheduler (lesson 04) raised ..."), the engine loop stops with
that message, and every open request, ``/health``, the log and the live page say it; the server
never hangs. ``LLM(learner=True)`` plugs the components in during each of its calls only
(``plugged``), raises the same error, and keeps the outputs that finished before it.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

from minipaged.engine.llm_engine import LLMEngine
from minipaged.exercises import capstone, capstone_runs, workbench
from minipaged.exercises.capstone_steps import PHASE3

# Saved components the served engine leaves out, and why.
LEFT_OUT = {PHASE3: "your CUDA phase 3 runs in the capstone's kernel run only: built for the "
                    "CPU, a decode step of the embedded model takes seconds"}


class LearnerComponentError(RuntimeError):
    """A component the learner wrote raised while the engine served."""


def _lesson(name: str) -> str:
    try:
        return workbench.component(name).lesson
    except KeyError:
        return "?"


def _blamed(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LearnerComponentError:
            raise
        except Exception as e:
            raise LearnerComponentError(f"your {name} (lesson {_lesson(name)}) raised "
                                        f"{type(e).__name__}: {e}") from e
    return call


@contextlib.contextmanager
def blaming(objects: dict[str, object]) -> Iterator[dict[str, object]]:
    """``objects`` (name -> the learner's function or class) whose exceptions name them: a
    function is wrapped, a class has its own methods wrapped for the block."""
    wrapped: dict[str, object] = {}
    patched: list[tuple[type, str, object]] = []
    try:
        for name, obj in objects.items():
            if isinstance(obj, type):
                for attr, value in list(vars(obj).items()):
                    if callable(value) and not isinstance(value, type):
                        patched.append((obj, attr, value))
                        setattr(obj, attr, _blamed(name, value))
                wrapped[name] = obj
            else:
                wrapped[name] = _blamed(name, obj) if callable(obj) else obj
        yield wrapped
    finally:
        for cls, attr, value in reversed(patched):
            setattr(cls, attr, value)


def what_runs(found: dict, missing: list[str], broken: dict[str, str]) -> str:
    """Which parts of the served engine are the learner's and which still the package's."""
    lines = ["the engine served is yours where you saved a component:"]
    lines += [f"  yours:     {name} (lesson {_lesson(name)})" for name in found]
    lines += [f"  package's: {name} (lesson {_lesson(name)}: nothing saved yet)"
              for name in missing]
    lines += [f"  package's: {name} ({why})" for name, why in broken.items()]
    lines += [f"  package's: {name} ({why})" for name, why in LEFT_OUT.items()]
    return "\n".join(lines)


def learner_parts() -> tuple[dict[str, object], str]:
    """(the learner's saved components that load, by name; ``what_runs``), collected as the
    capstone collects them."""
    names = [n for n in capstone_runs.capstone_names() if n not in LEFT_OUT]
    found, missing, broken = capstone.collect(names)
    return found, what_runs(found, missing, broken)


@contextlib.contextmanager
def plugged(found: dict[str, object]) -> Iterator[None]:
    """Inside the block the engine runs ``found`` (``learner_parts``), each of them named
    when it raises; the package's own come back when the block ends."""
    with blaming(found) as wrapped, workbench.plugged_in(objects=wrapped, quiet=True):
        yield


@contextlib.contextmanager
def learner_engine(model: str | None = None, **settings) -> Iterator[tuple[LLMEngine, str]]:
    """(an ``LLMEngine`` with the learner's saved components plugged in, ``what_runs``);
    the package's own come back when the block ends."""
    found, report = learner_parts()
    with plugged(found):
        yield LLMEngine(model, **settings), report


def serve(args) -> int:
    """``minipaged serve --learner``: the usual server around ``learner_engine``."""
    import sys

    from minipaged.entrypoints import cli

    try:
        options = cli.server_options(args)
        with learner_engine(args.model, **cli.engine_kwargs(args)) as (engine, report):
            print(f"minipaged: {report}", flush=True)
            return cli.run_server(args, options, engine)
    except (ValueError, OSError) as e:
        print(f"minipaged: error: {e}", file=sys.stderr)
        return 2
