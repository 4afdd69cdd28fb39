"""Every lesson's block pictures, rendered: each call of ``render_block_tables``, ``StepPlayer`` or
``EventPlayer`` in a lesson's code cells is drawn with the keyword arguments the lesson gives it
(a literal as written; an expression replaced by a value of the same kind: this step's marks, two
held blocks, a title), over every step of an engine that shares, copies, preempts by swap and by
recompute, and frees. Each picture must carry the one legend of ``visualizer/legend.py`` (every
kind, in its order, each swatch in its look), draw every mark in its kind's look, and say in the
legend which step kinds it shows: a mark means the same thing in every lesson.
"""
import ast
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from test_visualizer_legend import NS, _drawn_marks, _groups, _legend, run  # noqa: F401 (fixture)
from visualizer import render_block_tables
from visualizer.legend import LOOKS, STEP_KINDS, step_kind, step_marks

LESSONS = Path(__file__).parents[2] / "lessons"
PICTURES = ("render_block_tables", "StepPlayer", "EventPlayer")


def lesson_calls() -> list[tuple[str, str, dict]]:
    """(lesson, the picture's function, its keyword arguments: a literal, or ``EXPR``)."""
    calls = []
    for path in sorted(LESSONS.glob("*.ipynb")):
        for cell in nbformat.read(path, 4).cells:
            if cell.cell_type != "code":
                continue
            source = "\n".join(line for line in cell.source.splitlines()
                               if not line.lstrip().startswith(("%", "!")))
            for node in ast.walk(ast.parse(source)):
                name = getattr(node, "func", None)
                name = getattr(name, "id", None) or getattr(name, "attr", None)
                if isinstance(node, ast.Call) and name in PICTURES:
                    calls.append((path.name[:2], name, {k.arg: _value(k.value)
                                                        for k in node.keywords if k.arg}))
    return calls


EXPR = object()  # an argument the lesson computes


def _value(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return EXPR


CALLS = lesson_calls()


def test_the_lessons_draw_block_pictures():
    lessons = {lesson for lesson, _, _ in CALLS}
    assert {"02", "03", "04", "11", "16", "19"} <= lessons, lessons
    assert all(name in PICTURES for _, name, _ in CALLS)


def assert_one_language(svg: str, previous: dict | None, snap, mark_kind: str | None = None,
                        highlighted: set[int] = frozenset()) -> dict[str, set[int]]:
    root = ET.fromstring(svg)
    legend = _legend(root)
    assert list(legend) == list(LOOKS), legend  # every kind, in the legend's order
    for entry in _groups(root, "legend-entry"):
        look = LOOKS[entry.get("data-kind")]
        swatch = next(r for r in entry.iter(NS + "rect") if "legend-swatch" in r.get("class"))
        assert (swatch.get("stroke"), swatch.get("fill")) == (look.stroke, look.fill)
        assert swatch.get("stroke-dasharray") == look.dash
    drawn = _drawn_marks(root)
    for block in _groups(root, "physical-block"):
        mark = block.get("data-mark")
        outline = [r for r in block.iter(NS + "rect") if "step-mark" in (r.get("class") or "")]
        assert bool(outline) == bool(mark)
        if mark:
            assert (outline[0].get("stroke"), outline[0].get("stroke-dasharray")) == (
                LOOKS[mark].stroke, LOOKS[mark].dash), mark
    for kind in STEP_KINDS:
        assert legend[kind] == bool(drawn[kind]), (kind, legend, drawn)
    if snap is not None:  # (an event player's frame: its recording holds the blocks)
        after = snap.block_manager["gpu_blocks"]
        assert legend["shared"] == any(b["ref_count"] > 1 for b in after)
    if mark_kind is not None:  # a highlight: the blocks asked for, in the look of its word
        assert highlighted <= drawn[mark_kind], (mark_kind, highlighted, drawn)
    return drawn


def _arguments(kwargs: dict, previous, snap) -> tuple[dict, str | None, set[int]]:
    """The lesson's arguments with each expression given a value of its kind."""
    held = sorted({b for s in snap.block_manager["sequences"] if s["device"] == "gpu"
                   for b in s["block_table"] if b >= 0})[:2]
    args, mark, highlighted = {}, None, set()
    for key, value in kwargs.items():
        if key == "title":
            args[key] = value if value is not EXPR else "a lesson's title"
        elif key == "marks":
            args[key] = step_marks(previous, snap.block_manager, snap.blocks_to_copy,
                                   snap.preempted)
        elif key == "highlight_blocks":
            args[key] = held if value is EXPR else value
        elif key == "highlight_mark":
            args[key] = "copied" if value is EXPR else value
        elif value is not EXPR:
            args[key] = value
    if "highlight_blocks" in args:
        mark, highlighted = step_kind(args.get("highlight_mark")), set(args["highlight_blocks"])
    return args, mark, highlighted


@pytest.mark.parametrize("lesson, name, kwargs",
                         [c for c in CALLS if c[1] == "render_block_tables"],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_lessons_render_call_speaks_the_legend(run, lesson, name, kwargs):
    for mode, (_, snaps, _) in run.items():
        for i, snap in enumerate(snaps):
            previous = snaps[i - 1].block_manager if i else None
            args, mark, highlighted = _arguments(kwargs, previous, snap)
            if mark is not None and "marks" not in args:
                highlighted = highlighted & {b["block_number"] for b in
                                             snap.block_manager["gpu_blocks"]}
            svg = render_block_tables(snap.block_manager, **args)
            assert_one_language(svg, previous, snap, mark, highlighted)


@pytest.mark.parametrize("lesson, name, kwargs",
                         [c for c in CALLS if c[1] != "render_block_tables"],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_lessons_player_speaks_the_legend(run, lesson, name, kwargs):
    pytest.importorskip("ipywidgets")
    from visualizer.widgets import EventPlayer, StepPlayer

    literal = {k: v for k, v in kwargs.items() if v is not EXPR}
    for mode, (_, snaps, recorder) in run.items():
        if name == "StepPlayer":
            player = StepPlayer(snaps, **literal)
            frames = [player.frame(i)[1][1] for i in range(len(snaps))]
            befores = [snaps[i - 1].block_manager if i else None for i in range(len(snaps))]
            for svg, previous, snap in zip(frames, befores, snaps):
                assert_one_language(svg, previous, snap)
        else:
            player = EventPlayer(recorder.steps, **literal)
            for i in range(len(recorder.steps)):
                assert_one_language(player.frame(i)[1][0], None, None)
