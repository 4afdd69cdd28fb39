"""Requests over engine steps: when each one waited, ran its prefill, decoded, and finished.

    render_timeline(step_snapshots, arrivals={"0": 1, "1": 1, "2": 4, ...})

One row per request, one column per engine step (lesson 09: continuous against static
batching). A cell says what the request did in that step: waiting (arrived, not running),
prefill, decode, or preempted. Elements for tests: ``timeline-cell`` (``data-request``,
``data-step``, ``data-state``) and ``timeline-row`` (``data-request``, ``data-arrival``,
``data-finish``).
"""
from __future__ import annotations

from visualizer.svg import FREE_FILL, INK, MUTED, caption, el, svg_root, text, to_string

STATE_FILL = {"waiting": "#f2d7a0", "prefill": "#4e79a7", "decode": "#a0cbe8",
              "preempted": "#e15759"}
STATE_LABEL = {"waiting": "waiting (arrived, not admitted)", "prefill": "prefill (its prompt)",
               "decode": "decode (one token)", "preempted": "preempted"}
CELL_W, ROW_H, LABEL_W = 12, 16, 70


def timeline_states(snapshots, arrivals: dict[str, int]) -> dict[str, dict[int, str]]:
    """{request id: {step: state}} from the engine's ``StepSnapshot`` list."""
    states: dict[str, dict[int, str]] = {rid: {} for rid in arrivals}
    finished: dict[str, int] = {}
    for snap in snapshots:
        ran = dict(zip(snap.scheduled, snap.prompt_run))
        preempted = {rid for rid, _ in snap.preempted}
        for rid, arrival in arrivals.items():
            if snap.step < arrival or rid in finished:
                continue
            if rid in preempted:
                states[rid][snap.step] = "preempted"
            elif rid in ran:
                states[rid][snap.step] = "prefill" if ran[rid] else "decode"
            else:
                states[rid][snap.step] = "waiting"
        for rid in snap.finished:
            finished.setdefault(rid, snap.step)
    return states


def render_timeline(snapshots, arrivals: dict[str, int], title: str | None = None,
                    num_steps: int | None = None) -> str:
    """SVG: requests (rows) against the steps of the run (columns, counted from 1).

    ``num_steps``: draw that many columns (at least the run's own), so that two runs drawn one
    above the other share their step axis and their width.
    """
    states = timeline_states(snapshots, arrivals)
    first = min((s.step for s in snapshots), default=1)
    ran = max((s.step for s in snapshots), default=first) - first + 1
    num_steps = max(ran, num_steps or 0)
    last = first + num_steps - 1
    top = 40 if title else 22
    plot_w = num_steps * CELL_W
    width = max(LABEL_W + plot_w + 20, 420)
    legend_y = top + 16 + len(arrivals) * ROW_H + 34
    height = legend_y + 16 * len(STATE_FILL) + 6
    root = svg_root(width, height, "timeline", data_num_steps=num_steps)
    if title:
        caption(root, 10, 18, title)
    every = max(1, round(40 / CELL_W))  # a step number every ~40 px
    for step in range(first, last + 1):
        if (step - first) % every == 0:
            text(root, LABEL_W + (step - first) * CELL_W, top + 8, step - first + 1, size=8,
                 fill=MUTED, class_="tick")
    for i, (rid, arrival) in enumerate(arrivals.items()):
        y = top + 16 + i * ROW_H
        steps = states[rid]
        finish = max(steps) if steps else None
        row = el(root, "g", class_="timeline-row", data_request=rid, data_arrival=arrival,
                 data_finish=finish if finish is not None else "")
        text(row, 10, y + 11, f"req {rid}", size=10)
        el(row, "rect", x=LABEL_W, y=y + 1, width=plot_w, height=ROW_H - 2, fill=FREE_FILL)
        for step, state in steps.items():
            el(row, "rect", x=LABEL_W + (step - first) * CELL_W, y=y + 1, width=CELL_W - 1,
               height=ROW_H - 2, fill=STATE_FILL[state], class_="timeline-cell",
               data_request=rid, data_step=step, data_state=state)
    text(root, LABEL_W, legend_y - 18, f"step of the run → (the run took {ran} steps)", size=9,
         fill=MUTED)
    for k, (state, fill) in enumerate(STATE_FILL.items()):
        y = legend_y + 16 * k
        el(root, "rect", x=10, y=y - 9, width=10, height=10, fill=fill)
        text(root, 26, y, STATE_LABEL[state], size=10, fill=INK)
    return to_string(root)
