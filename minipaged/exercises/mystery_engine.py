"""Lesson 19's mystery engine: an engine with a fault active during its own calls only.

A fault is a few package functions replaced (``unittest.mock.patch``) while the suspect runs its
``step``, ``add_request`` or ``abort_request``, and put back after: an engine next to it, the
reference, never sees the fault (``exercises/lesson19.py`` draws which one).
"""
from __future__ import annotations

import contextlib


class MysteryEngine:
    """An ``LLMEngine`` whose fault is active during its own ``step``, ``add_request`` and
    ``abort_request``; everything else is the engine's (``suspect.scheduler``, ...)."""

    def __init__(self, engine, fault) -> None:
        self._engine = engine
        self._fault = fault

    @contextlib.contextmanager
    def _faulty(self):
        with contextlib.ExitStack() as stack:
            for patch in self._fault.patches:
                stack.enter_context(patch(self._engine))
            yield

    def step(self):
        with self._faulty():
            return self._engine.step()

    def add_request(self, *args, **kwargs):
        with self._faulty():
            return self._engine.add_request(*args, **kwargs)

    def abort_request(self, request_id: str):
        with self._faulty():
            return self._engine.abort_request(request_id)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def __repr__(self) -> str:
        return "MysteryEngine(the package's LLMEngine with one hidden fault)"
