"""The live page's drawings (``minipaged serve``, lesson 13): the lessons' own renderers, fed the
frame the server builds after a step (``minipaged/entrypoints/live_feed.py``).

    draw_frame({"block_manager": ..., "scheduler": ..., "step": ...})
        -> {"blocks": render_block_tables(...), "queues": render_scheduler(...)}

The blocks a copy-on-write copy just wrote are outlined and marked "copy"; a preempted group is
outlined in red by ``render_scheduler``. The server finds this module by name at start-up (it
sits above the engine's layers, which never import the visualizer).
"""
from __future__ import annotations

from visualizer.block_tables import render_block_tables
from visualizer.scheduler_view import render_scheduler

MAX_POOL_BLOCKS = 96  # a larger pool is drawn as its held blocks and the next free ones


def draw_frame(frame: dict) -> dict[str, str]:
    """SVG drawings of one step for the page.

    Args:
        frame: ``block_manager`` (``BlockSpaceManager.snapshot()``, token ids may be emptied),
            ``scheduler`` (``Scheduler.snapshot()``) and ``step`` (the ``StepSnapshot`` fields
            ``render_scheduler`` reads, and ``step``).
    """
    step = frame["step"]
    copied = [dst for dsts in step.get("blocks_to_copy", {}).values() for dst in dsts]
    title = f"step {step.get('step', 0)}"
    if step.get("preempted"):
        title += " · preempted: " + ", ".join(f"req {r} ({m})" for r, m in step["preempted"])
    return {
        "blocks": render_block_tables(frame["block_manager"], title=title,
                                      highlight_blocks=copied,
                                      highlight_mark="copy" if copied else None,
                                      max_pool_blocks=MAX_POOL_BLOCKS),
        "queues": render_scheduler(frame["scheduler"], step=step),
    }
