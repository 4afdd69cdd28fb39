"""The scheduler's three queues and the two pools, drawn from ``Scheduler.snapshot()``.

    waiting | running | swapped        one badge per sequence group, oldest at the top
    GPU pool [#####.....]  CPU pool [##........]

A badge is filled with its sequences' colours, the colours ``render_block_tables`` gives their
block tables (stripes when a group has several), so a badge and its tables match side by side;
a preempted group is outlined in red.

Elements for tests: ``queue`` (``data-queue``, ``data-count``), ``badge`` (``data-queue``,
``data-request``, ``data-num-seqs``, ``data-num-tokens``, ``data-preempted``) with its
``badge-fill`` stripes (``data-seq``), and ``pool-bar`` (``data-pool``, ``data-used``,
``data-total``).
"""
from __future__ import annotations

import textwrap

from visualizer.svg import (FREE_FILL, HIGHLIGHT, INK, MUTED, caption, colour, el, shorten,
                            svg_root, text, to_string)

QUEUES = ("waiting", "running", "swapped")
COL_W, BADGE_W, BADGE_H = 210, 190, 36
NOTE_CHARS = 100  # characters of a size-10 note line that fit in the drawing's width
BADGE_CHARS = int((BADGE_W - 12) / (0.6 * 10))  # characters of a size-10 line inside a badge


def _badge_fill(parent, x: float, y: float, seq_ids: list[int]) -> None:
    """A badge's background in its sequences' colours, the colours of their block tables: one
    colour for one sequence, equal stripes for several (as a shared block is striped)."""
    seq_ids = seq_ids or [0]
    w = BADGE_W / len(seq_ids)
    for i, seq_id in enumerate(seq_ids):
        el(parent, "rect", x=x + i * w, y=y, width=w, height=BADGE_H, fill=colour(seq_id),
           opacity=0.25, class_="badge-fill", data_seq=seq_id)


def render_scheduler(snapshot: dict, title: str | None = None, step: dict | None = None) -> str:
    """SVG of the queues and pool occupancy in ``snapshot`` (``Scheduler.snapshot()``).

    Args:
        title: a line above the drawing.
        step: optional facts of the step that produced the snapshot (the fields of the engine's
            ``StepSnapshot``: ``scheduled``, ``prompt_run``, ``preempted``, ``blocks_to_swap_in``,
            ``blocks_to_swap_out``, ``blocks_to_copy``, ``finished``); they are written under the
            queues and preempted groups are marked.
    """
    step = step or {}
    preempted = {rid: mode for rid, mode in step.get("preempted", [])}
    prefill = {rid for rid, p in zip(step.get("scheduled", []), step.get("prompt_run", [])) if p}
    top = 44 if title else 24
    longest = max([len(snapshot[q]) for q in QUEUES] + [1])
    pools_y = top + 22 + longest * (BADGE_H + 6) + 10
    notes = _step_notes(step)
    width = 3 * COL_W + 20
    height = pools_y + 2 * 34 + 16 * len(notes) + 10
    root = svg_root(width, height, "scheduler-view")
    if title:
        caption(root, 10, 18, title)

    for col, queue in enumerate(QUEUES):
        x = 10 + col * COL_W
        groups = snapshot[queue]
        g = el(root, "g", class_="queue", data_queue=queue, data_count=len(groups))
        text(g, x, top + 10, f"{queue} ({len(groups)})", weight="bold")
        for i, badge in enumerate(groups):
            y = top + 20 + i * (BADGE_H + 6)
            rid = badge["request_id"]
            mode = preempted.get(rid)
            b = el(g, "g", class_="badge", data_queue=queue, data_request=rid,
                   data_num_seqs=badge["num_seqs"], data_num_tokens=badge["num_tokens"],
                   data_preempted=mode or "", data_seq_ids=",".join(map(str, badge["seq_ids"])))
            _badge_fill(b, x, y, badge["seq_ids"])
            el(b, "rect", x=x, y=y, width=BADGE_W, height=BADGE_H, rx=6, fill="none",
               stroke=HIGHLIGHT if mode else INK, stroke_width=2 if mode else 1)
            seqs = "seq" if badge["num_seqs"] == 1 else "seqs"
            count = f" · {badge['num_seqs']} {seqs}" + (
                f" ({badge['num_unfinished']} live)"
                if badge["num_unfinished"] != badge["num_seqs"] else "")
            rid_text = shorten(rid, BADGE_CHARS - len("req ") - len(count))
            text(b, x + 6, y + 14, f"req {rid_text}{count}", size=10, weight="bold")
            detail = f"{badge['num_tokens']} tokens"
            if mode:
                detail += f" · preempted ({mode})"
            elif badge.get("prefill_progress"):  # a prompt split over several steps
                done, total = badge["prefill_progress"]
                detail += f" · prefilled {done}/{total}"
            elif rid in prefill:
                detail += " · prefill this step"
            text(b, x + 6, y + 29, shorten(detail, BADGE_CHARS), size=10,
                 fill=HIGHLIGHT if mode else INK)
        if not groups:
            text(g, x, top + 34, "(empty)", size=10, fill=MUTED)

    y = pools_y
    for pool, total_key, free_key in (("gpu", "num_gpu_blocks", "num_free_gpu_blocks"),
                                      ("cpu", "num_cpu_blocks", "num_free_cpu_blocks")):
        total, free = snapshot[total_key], snapshot[free_key]
        used = total - free
        g = el(root, "g", class_="pool-bar", data_pool=pool, data_used=used, data_total=total)
        name = "GPU pool" if pool == "gpu" else "CPU pool (swap)"
        text(g, 10, y + 12, f"{name}: {used}/{total} blocks used", size=10, weight="bold")
        bar_x, bar_w = 240, width - 250
        el(g, "rect", x=bar_x, y=y + 2, width=bar_w, height=14, fill=FREE_FILL, stroke=MUTED)
        if total:
            el(g, "rect", x=bar_x, y=y + 2, width=bar_w * used / total, height=14,
               fill="#4e79a7" if pool == "gpu" else "#9c755f", class_="pool-used")
        y += 34
    for note in notes:
        text(root, 10, y + 4, note, size=10, class_="step-note")
        y += 16
    return to_string(root)


def _step_notes(step: dict) -> list[str]:
    notes = []
    if step.get("scheduled"):
        runs = list(zip(step["scheduled"], step.get("prompt_run", [])))
        for kind, is_prompt in (("prefill", True), ("decode", False)):
            ids = [str(rid) for rid, p in runs if bool(p) == is_prompt]
            if ids:
                notes.append(f"{kind}: req " + ", ".join(ids))
    for key, label in (("blocks_to_swap_out", "swap out GPU→CPU"),
                       ("blocks_to_swap_in", "swap in CPU→GPU"),
                       ("blocks_to_copy", "copy-on-write src→dst")):
        if step.get(key):
            notes.append(f"{label}: " + ", ".join(f"{s}→{d}" for s, d in step[key].items()))
    if step.get("finished"):
        notes.append("finished: " + ", ".join(f"req {r}" for r in step["finished"]))
    # One note may be long (many groups, many blocks): wrap it to the drawing's width.
    return [line for note in notes
            for line in textwrap.wrap(note, NOTE_CHARS, subsequent_indent="    ")]
