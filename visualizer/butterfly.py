"""A butterfly reduction drawn lanes x steps, from the kernel emulator's trace (lesson 05).

Each column is the warp's 32 lanes after one shuffle step; a line goes from the lane that was
read (``partner = lane ^ mask``) to the lane that read it. Cells are coloured by *team*: the
lanes whose values have been combined so far, one colour per team in each column (at most 16
teams after the first mask; before it every lane is alone, drawn grey). After the last mask every
lane of a team holds the same result.

Records come from ``minipaged.lab.emulator`` (``butterfly_reduce(..., trace=[])`` or
``paged_attention(..., trace=[])``): dicts with ``phase``, ``step``, ``mask``, ``pairs``,
``values_before`` and ``values_after`` (see that module's docstring).

Elements for tests: ``lane-value`` (``data-lane``, ``data-column``, ``data-value``) and
(``data-team``, ``data-fill``) and ``exchange`` (``data-step``, ``data-mask``, ``data-lane``, ``data-partner``).
"""
from __future__ import annotations

import math

from visualizer.svg import FREE_FILL, INK, MUTED, caption, el, svg_root, text, to_string

LANE_H, CELL_W, GAP = 16, 68, 70
# 16 colours that stay apart at a glance (Tableau 20 without its greys and two near-repeats),
# dark and light alternating so that neighbouring teams differ most.
TEAM_COLOURS = ["#4e79a7", "#ffbe7d", "#59a14f", "#ff9d9a", "#b07aa1", "#86bcb6", "#f28e2b",
                "#8cd17d", "#e15759", "#a0cbe8", "#b6992d", "#fabfd2", "#499894", "#f1ce63",
                "#9d7660", "#d4a6c8"]
_KEYS = ("phase", "stage", "seq", "head", "warp", "block", "slot")


def butterfly_steps(trace: list[dict], index: int = 0, **match) -> list[dict]:
    """The records of one butterfly: the ``index``-th run of steps 0, 1, ... whose fields equal
    ``match`` (e.g. ``phase="max", warp=0``)."""
    runs: list[list[dict]] = []
    for record in trace:
        if any(record.get(k) != v for k, v in match.items()):
            continue
        key = tuple(record.get(k) for k in _KEYS)
        if record["step"] == 0 or not runs or tuple(runs[-1][-1].get(k) for k in _KEYS) != key:
            runs.append([])
        runs[-1].append(record)
    if index >= len(runs):
        raise ValueError(f"the trace has {len(runs)} butterflies matching {match}, "
                         f"not {index + 1}")
    return runs[index]


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if abs(v) >= 1e30:
        return "-FLT_MAX" if v < 0 else "FLT_MAX"
    return f"{v:.4g}"


def render_butterfly(records: list[dict], title: str | None = None) -> str:
    """SVG of one butterfly: ``records`` are its steps in order (see ``butterfly_steps``)."""
    if not records:
        raise ValueError("no trace records to draw")
    num_lanes = len(records[0]["values_before"])
    columns = [records[0]["values_before"]] + [r["values_after"] for r in records]
    top = 58 if title else 38
    width = 50 + len(columns) * CELL_W + (len(columns) - 1) * GAP + 10
    footer = (f"{records[0].get('phase') or 'reduce'}: every lane l reads lane l ^ mask and "
              f"combines it with its own value")
    # Never clip the title or the footer: widen the drawing to the longest line of text.
    width = max(width, 20 + 0.6 * 13 * len(title or ""), 20 + 0.6 * 10 * len(footer))
    height = top + num_lanes * LANE_H + 24
    first = records[0]
    root = svg_root(width, height, "butterfly", data_phase=first.get("phase") or "",
                    data_num_steps=len(records),
                    data_masks=",".join(str(r["mask"]) for r in records))
    if title:
        caption(root, 10, 18, title)

    def col_x(c: int) -> float:
        return 50 + c * (CELL_W + GAP)

    def lane_y(lane: int) -> float:
        return top + lane * LANE_H

    for lane in range(num_lanes):
        text(root, 44, lane_y(lane) + 11, f"lane {lane}", size=9, anchor="end", fill=MUTED)

    combined = 0  # bits of the masks used so far: lanes differing only there form a team
    for c, values in enumerate(columns):
        x = col_x(c)
        header = "before" if c == 0 else f"mask {records[c - 1]['mask']}"
        text(root, x + CELL_W / 2, top - 8, header, size=10, anchor="middle", weight="bold")
        if c:
            combined |= records[c - 1]["mask"]
        teams = sorted({lane & ~combined for lane in range(len(values))})
        for lane, v in enumerate(values):
            team = lane & ~combined
            fill = (FREE_FILL if not combined or len(teams) > len(TEAM_COLOURS)
                    else TEAM_COLOURS[teams.index(team)])
            cell = el(root, "g", class_="lane-value", data_lane=lane, data_column=c,
                      data_value=_fmt(v), data_team=team, data_fill=fill)
            el(cell, "rect", x=x, y=lane_y(lane) + 1, width=CELL_W, height=LANE_H - 2,
               fill=fill, opacity=0.55)
            text(cell, x + CELL_W / 2, lane_y(lane) + 11, _fmt(v), size=9, anchor="middle")

    for s, record in enumerate(records):
        group = el(root, "g", class_="step", data_step=s, data_mask=record["mask"])
        x1, x2 = col_x(s) + CELL_W, col_x(s + 1)
        for lane, partner in record["pairs"]:
            # the lane's own value carries on, and it reads its partner's value
            el(group, "line", x1=x1, y1=lane_y(lane) + LANE_H / 2, x2=x2,
               y2=lane_y(lane) + LANE_H / 2, stroke="#cccccc", stroke_width=0.6)
            el(group, "line", x1=x1, y1=lane_y(partner) + LANE_H / 2, x2=x2,
               y2=lane_y(lane) + LANE_H / 2, stroke=INK if partner > lane else "#4e79a7",
               stroke_width=0.8, opacity=0.8, class_="exchange", data_step=s,
               data_mask=record["mask"], data_lane=lane, data_partner=partner)
    text(root, 10, height - 8, footer, size=10, fill=MUTED)
    return to_string(root)
