"""One visual language for every block picture (lessons 02, 03, 08, 11, 13, 16, 19, 20).

A block in the pool can be in a state (free, shared, cached, evictable) and can have changed in
the step being shown (new, copied, freed, preempted); each has one look, defined here only, and a
word written in the block where there is room. Every block picture draws the same legend under
itself; a kind that the picture does not show is drawn faded, so "nothing was copied this step"
reads as plainly as a copy.

    kind        outline                       word        when
    free        thin grey, grey body          -           ref count 0
    shared      black, dashed                 shared      ref count > 1
    new         red                           new         a sequence's table took it this step
    copied      purple, double width          copied      this step's copy-on-write target
    freed       orange, dashed, grey body     freed       its last reference went this step
    preempted   brown, dotted, grey body      preempted   its request was preempted this step
                                                          (recompute: freed; swap: moved to CPU)
    cached      green                         cached      findable by hash (lesson 11)
    evictable   green, dotted, grey body      evictable   cached, nobody holds it: counts as free
    newest      a red slot                    -           each sequence's newest token

``step_marks(previous, current)`` finds the step's changes from two snapshots and the engine's
``blocks_to_copy`` and ``preempted``: the marks are facts of the snapshots, never guesses.
"""
from __future__ import annotations

from dataclasses import dataclass

from visualizer.svg import FREE_FILL, HIGHLIGHT, INK, MUTED, el, text, text_width

CACHED = "#2a9d4a"  # prefix-cached blocks (lesson 11): the green of the legend and the prose
COPIED = "#6a1b9a"
FREED = "#e07b00"
PREEMPTED = "#7f3b08"


@dataclass(frozen=True)
class Look:
    label: str  # the legend's words
    fill: str  # the swatch's (and, for a free kind, the block's) fill
    stroke: str
    dash: str | None
    width: float
    word: str | None  # written inside a block of this kind


LOOKS: dict[str, Look] = {
    "free": Look("free", FREE_FILL, "#bbbbbb", None, 1, None),
    "shared": Look("shared: ref count > 1", "white", INK, "4 2", 2, "shared"),
    "new": Look("new: taken this step", "white", HIGHLIGHT, None, 2.5, "new"),
    "copied": Look("copied: copy-on-write this step", "white", COPIED, None, 3, "copied"),
    "freed": Look("freed this step", FREE_FILL, FREED, "5 2", 2.5, "freed"),
    "preempted": Look("preempted this step", FREE_FILL, PREEMPTED, "1 2", 2.5, "preempted"),
    "cached": Look("cached: findable by hash", "#cad7e5", CACHED, None, 1.5, "cached"),
    "evictable": Look("evictable: free, keeps its KV", FREE_FILL, CACHED, "2 2", 1.5,
                      "evictable"),
    "newest": Look("newest token", "white", HIGHLIGHT, None, 1.5, None),
}
# The changes of a step, by precedence where one block has several (a block freed by a
# preemption and taken by another sequence in the same step shows "preempted").
STEP_KINDS = ("copied", "preempted", "new", "freed")
# Words the callers of ``render_block_tables(highlight_mark=...)`` used before the legend.
MARK_WORDS = {"copy": "copied", "copied": "copied", "freed": "freed", "free": "freed",
              "new": "new", "preempted": "preempted"}

LEGEND_ROW_H = 16
_SWATCH_W, _SWATCH_H = 16, 11


def step_kind(word: str | None) -> str:
    """The legend's kind for a highlight word ("copy" -> "copied"); None is "new"."""
    if word is None:
        return "new"
    if word not in MARK_WORDS:
        raise ValueError(f"highlight_mark {word!r} is not a mark of the legend: use one of "
                         f"{sorted(MARK_WORDS)} (visualizer/legend.py)")
    return MARK_WORDS[word]


def _entry_width(kind: str) -> float:
    return _SWATCH_W + 5 + text_width(LOOKS[kind].label, 9) + 14


def legend_height(width: float) -> float:
    """How tall the legend is when it wraps within ``width``."""
    rows, x = 1, 0.0
    for kind in LOOKS:
        w = _entry_width(kind)
        if x and x + w > width:
            rows, x = rows + 1, 0.0
        x += w
    return rows * LEGEND_ROW_H + 8


def draw_legend(root, x0: float, y: float, width: float, present: set[str]):
    """Every kind's swatch and words, wrapped within ``width``; the kinds not in ``present``
    faded. Each entry is ``legend-entry`` with ``data-kind`` and ``data-present``."""
    group = el(root, "g", class_="legend")
    x, y = x0, y + 4
    for kind, look in LOOKS.items():
        w = _entry_width(kind)
        if x > x0 and x + w > x0 + width:
            x, y = x0, y + LEGEND_ROW_H
        shown = kind in present
        entry = el(group, "g", class_="legend-entry", data_kind=kind, data_present=shown,
                   opacity=None if shown else 0.35)
        if kind == "newest":  # a slot, as in the blocks' strip
            el(entry, "rect", x=x + 4, y=y + 2, width=8, height=8, fill=look.fill,
               stroke=look.stroke, stroke_width=look.width, class_="legend-swatch")
        else:
            el(entry, "rect", x=x, y=y, width=_SWATCH_W, height=_SWATCH_H, fill=look.fill,
               stroke=look.stroke, stroke_width=look.width, stroke_dasharray=look.dash,
               class_="legend-swatch")
        text(entry, x + _SWATCH_W + 5, y + 9, look.label, size=9,
             fill=INK if shown else MUTED)
        x += w
    return group


def step_marks(previous: dict | None, current: dict, blocks_to_copy: dict | None = None,
               preempted=()) -> dict[str, list[int]]:
    """GPU blocks that changed in a step, by kind (``STEP_KINDS``), from the block manager's
    snapshot before and after the step and the step's ``blocks_to_copy`` and ``preempted``
    (``StepSnapshot``'s: ``[(request_id, mode)]``). A block is given one kind only.

    - copied: a destination of ``blocks_to_copy``;
    - preempted: held before by a sequence of a preempted request;
    - new: in a sequence's table now, not in that sequence's table before;
    - freed: held before (ref count > 0), free now.
    """
    marks: dict[str, set[int]] = {kind: set() for kind in STEP_KINDS}
    marks["copied"] = {dst for dsts in (blocks_to_copy or {}).values() for dst in dsts}
    if previous is not None:
        gone = {str(request_id) for request_id, _ in preempted}
        marks["preempted"] = {b for s in previous["sequences"] if s["device"] == "gpu"
                              and str(s["request_id"]) in gone for b in s["block_table"]
                              if b >= 0}
        held = {(s["seq_id"], b) for s in previous["sequences"] if s["device"] == "gpu"
                for b in s["block_table"]}
        marks["new"] = {b for s in current["sequences"] if s["device"] == "gpu"
                        for b in s["block_table"] if b >= 0 and (s["seq_id"], b) not in held}
        was_held = {b["block_number"] for b in previous["gpu_blocks"] if b["ref_count"] > 0}
        marks["freed"] = {b["block_number"] for b in current["gpu_blocks"]
                          if b["ref_count"] == 0 and b["block_number"] in was_held}
    seen: set[int] = set()
    out = {}
    for kind in STEP_KINDS:
        out[kind] = sorted(marks[kind] - seen)
        seen |= marks[kind]
    return out


def snapshot_marks(previous, snap) -> dict[str, list[int]]:
    """``step_marks`` of an engine ``StepSnapshot`` after ``previous`` (one, or None)."""
    return step_marks(previous.block_manager if previous is not None else None,
                      snap.block_manager, snap.blocks_to_copy, snap.preempted)
