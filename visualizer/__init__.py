"""minipaged's visualizers: SVG renderers of the engine's snapshots, and ipywidgets around them.

Renderers (plain functions, snapshot in, SVG string out; no ipywidgets needed):

    render_block_tables(BlockSpaceManager.snapshot())      lessons 02, 03, 06
    render_scheduler(Scheduler.snapshot())                 lesson 04
    render_butterfly(butterfly_steps(trace, phase="max"))  lessons 05, 06
    render_key_loads({variant: loads})                     lesson 05
    render_key_readers({kernel: who}, kv_heads, tokens)    lesson 18 (grouped-query reads)
    render_warp_visits(t), render_logits(t, block_size),
    render_phase4_sums(t, out_row)                          lesson 06 (the real kernel's loops)
    render_memory_waste(contiguous_report, paged_report)   lesson 01
    render_line_chart({"name": [(x, y), ...]})              lessons 04, 06 (measurements)
    render_pair_rotation([("p=0", x, y), ...])              lesson 07 (rotary embedding)

Recording and widgets:

    EventRecorder(block_manager)      (event, snapshot, caption) for every block operation
    EventPlayer(recorder)             Play button + step slider over a recording
    StepPlayer(step_snapshots)        the same over engine steps, with the scheduler's queues
    LiveBlockTableView(engine)        redraws after every engine step
    show_fork_tree(recorder, "0")     the fork tree of a request (our SVG, no graphviz needed)

Every block picture uses one legend (``visualizer/legend.py``: free, shared, new, copied, freed,
preempted, cached, evictable, newest token; ``step_marks`` finds a step's changes) and draws it
under itself.

The visualizer only reads snapshots; the engine never imports it (or ipywidgets).
"""
from visualizer.block_tables import render_block_tables
from visualizer.butterfly import butterfly_steps, render_butterfly
from visualizer.events import EventRecorder, RecordedStep, describe
from visualizer.fork_tree import (fork_tree_dot, fork_tree_nodes, fork_tree_text,
                                  render_fork_tree)
from visualizer.fork_tree_svg import render_fork_tree_svg, show_fork_tree
from visualizer.charts import render_line_chart
from visualizer.kernel_trace import (render_key_loads, render_key_readers, render_logits,
                                     render_phase4_sums, render_warp_visits)
from visualizer.memory_waste import render_memory_waste
from visualizer.rotary import render_pair_rotation
from visualizer.scheduler_view import render_scheduler
from visualizer.source import show_file_part, show_source

__all__ = [
    "render_block_tables", "render_scheduler", "render_butterfly", "butterfly_steps",
    "render_memory_waste", "render_line_chart", "render_warp_visits", "render_logits",
    "render_phase4_sums", "render_key_loads", "render_key_readers", "render_pair_rotation",
    "EventRecorder",
    "RecordedStep", "describe",
    "fork_tree_nodes", "show_source", "show_file_part",
    "fork_tree_dot", "fork_tree_text", "render_fork_tree", "render_fork_tree_svg",
    "show_fork_tree",
    "EventPlayer", "StepPlayer", "LiveBlockTableView",
]


def __getattr__(name):
    # The widgets import ipywidgets; load them only when asked for.
    if name in ("EventPlayer", "StepPlayer", "LiveBlockTableView"):
        from visualizer import widgets

        return getattr(widgets, name)
    raise AttributeError(f"module 'visualizer' has no attribute {name!r}")
