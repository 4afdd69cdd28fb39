"""ipywidgets around the SVG renderers: a player over a recorded event log, and a live view.

- ``EventPlayer(recorder)``: a Play button and a step slider over an ``EventRecorder``; each step
  shows the block tables right after that event and its caption.
- ``StepPlayer(snapshots)``: the same over engine steps (``StepSnapshot`` objects an observer
  collected), showing the scheduler's queues next to the block tables.
- ``step_together(a, b)``: two ``StepPlayer``s that move as one (lesson 19).
- ``LiveBlockTableView(engine)``: an engine observer that redraws the block tables (and,
  optionally, the scheduler's queues beside them) after every ``engine.step()``, so the picture
  moves while ``llm.generate`` runs, pausing ``SECONDS_PER_STEP`` after each; when the run is
  over it shows the step that held the most blocks, with a replay. ``num_redraws`` counts the
  redraws; ``last_svg`` is the latest drawing.

The engine views draw the pool compactly (every held block, then a few free ones: a pool of 1456
blocks is not 1456 idle cells), and mark the step's changes (new, copied, freed, preempted
blocks) as the legend under every picture says (``visualizer/legend.py``).

Only this module imports ipywidgets; the engine never does.
"""
from __future__ import annotations

import html
import time

import ipywidgets as W

from visualizer.block_tables import render_block_tables
from visualizer.legend import snapshot_marks
from visualizer.scheduler_view import render_scheduler


def _caption_html(text: str) -> str:
    return f'<div class="minipaged-caption" style="font-family:monospace">{html.escape(text)}</div>'


def _figure_html(*svgs: str) -> str:
    # Side by side (queues left, block tables right) where the output area is wide enough; in a
    # narrower one the tables wrap below the queues instead of running off the right edge.
    parts = "".join(f'<div style="flex:none">{s}</div>' for s in svgs)
    return ('<div class="minipaged-figure" style="display:flex;flex-wrap:wrap;gap:12px;'
            f'align-items:flex-start;overflow-x:auto">{parts}</div>')


COMPACT_POOL = 24  # pool blocks drawn by the engine views: every held block, then a few free
SECONDS_PER_STEP = 0.4  # the live view's pause per step: slow enough to follow a table grow


class _Player(W.VBox):
    """A Play button and a slider over ``num_frames`` frames; subclasses draw frame i."""

    def __init__(self, num_frames: int, interval_ms: int, first: int = 0) -> None:
        if num_frames < 1:
            raise ValueError("nothing recorded")
        # The slider shows the step number the caption names (``first`` is frame 0's number).
        self.first = first
        last = first + num_frames - 1
        self.play = W.Play(value=first, min=first, max=last, step=1, interval=interval_ms,
                           description="play")
        self.slider = W.IntSlider(value=first, min=first, max=last, step=1, description="step",
                                  continuous_update=True)
        self.speed = W.IntSlider(value=interval_ms, min=100, max=3000, step=100,
                                 description="ms/step", continuous_update=False)
        W.jslink((self.play, "value"), (self.slider, "value"))
        W.jslink((self.speed, "value"), (self.play, "interval"))
        self.caption = W.HTML()
        self.view = W.HTML()
        self.caption.add_class("minipaged-player-caption")
        self.view.add_class("minipaged-player-view")
        super().__init__([W.HBox([self.play, self.slider, self.speed]), self.caption, self.view])
        self.slider.observe(lambda change: self.show(change["new"] - self.first), names="value")
        self.show(0)

    def frame(self, index: int) -> tuple[str, list[str]]:
        """(caption, SVGs) of frame ``index``."""
        raise NotImplementedError

    def show(self, index: int) -> None:
        caption, svgs = self.frame(index)
        self.caption.value = _caption_html(caption)
        self.view.value = _figure_html(*svgs)


class EventPlayer(_Player):
    """Step through a recorded event log (``EventRecorder`` or a list of ``RecordedStep``).

    Args:
        steps: the recording.
        interval_ms: time between frames when playing.
        show_scheduler: also draw the queues (needs a recorder made with a scheduler).
        render_kwargs: passed to ``render_block_tables`` (e.g. ``max_pool_blocks``).
    """

    def __init__(self, steps, interval_ms: int = 800, show_scheduler: bool = False,
                 **render_kwargs) -> None:
        self.steps = list(steps)
        self.show_scheduler = show_scheduler
        self.render_kwargs = render_kwargs
        super().__init__(len(self.steps), interval_ms)

    def render(self, index: int) -> str:
        """The block-table SVG of step ``index``."""
        step = self.steps[index]
        return render_block_tables(step.blocks, marks=step.marks,
                                   highlight_seq=step.highlight_seq, **self.render_kwargs)

    def frame(self, index: int) -> tuple[str, list[str]]:
        step = self.steps[index]
        svgs = [self.render(index)]
        if self.show_scheduler and step.scheduler is not None:
            svgs.append(render_scheduler(step.scheduler))
        return step.caption, svgs


def describe_engine_step(snap) -> str:
    """One line about an engine ``StepSnapshot``."""
    sched = snap.scheduler
    text = (f"engine step {snap.step}: ran {len(snap.scheduled)} "
            f"group{'' if len(snap.scheduled) == 1 else 's'}, "
            f"{sched['num_free_gpu_blocks']}/{sched['num_gpu_blocks']} GPU blocks free, "
            f"waiting {len(sched['waiting'])} · running {len(sched['running'])} · "
            f"swapped {len(sched['swapped'])}")
    for request_id, mode in snap.preempted:
        text += f"; request {request_id} preempted ({mode})"
    for request_id in snap.finished:
        text += f"; request {request_id} finished"
    return text


class StepPlayer(_Player):
    """Step through engine steps: a list of the ``StepSnapshot`` objects an observer collected
    (``engine.add_observer(snapshots.append)``); shows the queues and the block tables."""

    def __init__(self, snapshots, interval_ms: int = 800, **render_kwargs) -> None:
        self.snapshots = list(snapshots)
        render_kwargs.setdefault("max_pool_blocks", COMPACT_POOL)
        self.render_kwargs = render_kwargs
        first = self.snapshots[0].step if self.snapshots else 0
        super().__init__(len(self.snapshots), interval_ms, first=first)

    def frame(self, index: int) -> tuple[str, list[str]]:
        snap = self.snapshots[index]
        previous = self.snapshots[index - 1] if index else None
        return describe_engine_step(snap), [
            render_scheduler(snap.scheduler, step=vars(snap)),
            render_block_tables(snap.block_manager, marks=snapshot_marks(previous, snap),
                                **self.render_kwargs)]


def step_together(*players: StepPlayer) -> W.VBox:
    """The players one above the other, stepping together: moving one's slider (or playing it)
    moves the others to the same engine step, where they have it (lesson 19: the reference
    and the suspect side by side). Returns the box that shows them."""
    if len(players) < 2:
        raise ValueError(f"step_together needs two players or more, got {len(players)}")
    first = players[0]
    for other in players[1:]:
        W.link((first.slider, "value"), (other.slider, "value"))
        other.play.layout.display = "none"  # one Play button drives them all
    return W.VBox(list(players))


class LiveBlockTableView(W.VBox):
    """Redraw the block tables after every step of ``engine`` (an ``LLMEngine``), then, when the
    engine has nothing left to run, stay on the step that held the most blocks, with a Play
    button and a slider to go over the run again.

    Args:
        engine: the engine to observe (``llm.llm_engine``).
        show_scheduler: also draw the scheduler's queues next to the tables.
        seconds_per_step: the pause after each redraw while the engine runs (0: none), so that a
            person can follow the steps; the ``s/step`` slider changes it.
        keep_steps: the most recent steps kept for the replay.
        render_kwargs: passed to ``render_block_tables``.
    """

    def __init__(self, engine, show_scheduler: bool = False,
                 seconds_per_step: float = SECONDS_PER_STEP, keep_steps: int = 200,
                 **render_kwargs) -> None:
        if seconds_per_step < 0 or keep_steps < 1:
            raise ValueError(f"seconds_per_step must be >= 0 and keep_steps >= 1, got "
                             f"{seconds_per_step} and {keep_steps}")
        self.engine = engine
        self.show_scheduler = show_scheduler
        render_kwargs.setdefault("max_pool_blocks", COMPACT_POOL)
        self.render_kwargs = render_kwargs
        self.keep_steps = keep_steps
        self.num_redraws = 0
        self.last_svg: str | None = None
        self.last_snapshot = None  # the engine's StepSnapshot behind last_svg
        self.frames: list = []  # the kept StepSnapshots, for the replay
        self.shown_step: int | None = None  # the engine step the view shows
        self.caption = W.HTML(_caption_html("waiting for the first engine step"))
        self.speed = W.FloatSlider(value=seconds_per_step, min=0.0, max=2.0, step=0.1,
                                   description="s/step", continuous_update=False)
        # The replay: a Play button and a slider over the kept steps, live once the run is over;
        # both count engine steps (the number in the caption), as StepPlayer's slider does.
        self.play = W.Play(value=0, min=0, max=0, step=1, interval=int(1000 * SECONDS_PER_STEP),
                           description="replay")
        self.step_slider = W.IntSlider(value=0, min=0, max=0, description="step",
                                       disabled=True)
        W.jslink((self.play, "value"), (self.step_slider, "value"))
        self.step_slider.observe(lambda change: self._show_step(change["new"]), names="value")
        self.view = W.HTML(_figure_html(render_block_tables(engine.block_manager.snapshot(),
                                                            **self.render_kwargs)))
        super().__init__([W.HBox([self.speed, self.play, self.step_slider]), self.caption,
                          self.view])
        engine.add_observer(self._on_step)

    def _svgs(self, snap, previous) -> list[str]:
        svgs = [render_block_tables(snap.block_manager, marks=snapshot_marks(previous, snap),
                                    **self.render_kwargs)]
        if self.show_scheduler:
            svgs.insert(0, render_scheduler(snap.scheduler, step=vars(snap)))
        return svgs

    def _on_step(self, snap) -> None:
        svgs = self._svgs(snap, self.last_snapshot)
        self.last_svg = svgs[-1]
        self.last_snapshot = snap
        self.frames = (self.frames + [snap])[-self.keep_steps:]
        self.num_redraws += 1
        self.shown_step = snap.step
        self.caption.value = _caption_html(describe_engine_step(snap))
        self.view.value = _figure_html(*svgs)
        if not self.engine.has_unfinished_requests():
            self._settle()
        elif self.speed.value:
            time.sleep(self.speed.value)

    def _settle(self) -> None:
        """The run is over: show the step that held the most GPU blocks (the first such), not
        the empty pool every run ends on."""
        busiest = max(range(len(self.frames)), key=lambda i: (held_blocks(self.frames[i]), -i))
        first, last, shown = self.frames[0].step, self.frames[-1].step, self.frames[busiest].step
        # Max, then the value, then min: no value is ever out of range, so none is clamped (a
        # clamped Play value would come back through the browser's link after this one).
        for widget in (self.play, self.step_slider):  # (the slider's change draws the step)
            widget.max = max(widget.max, last)
            widget.value = shown
            widget.min, widget.max = first, last
        self.step_slider.disabled = False
        self._show_step(shown)

    def _show_step(self, step: int) -> None:
        """Draw the kept frame of engine step ``step`` (the replay's slider value)."""
        index = next((i for i, f in enumerate(self.frames) if f.step == step), None)
        if index is None:
            return
        snap = self.frames[index]
        previous = self.frames[index - 1] if index else None
        self.shown_step = snap.step
        most = max(held_blocks(f) for f in self.frames)
        note = (" · the run is over: the step that held the most blocks"
                if held_blocks(snap) == most else " · the run is over: replaying")
        self.caption.value = _caption_html(describe_engine_step(snap) + note)
        self.view.value = _figure_html(*self._svgs(snap, previous))

    def detach(self) -> None:
        """Stop observing the engine."""
        try:
            self.engine.remove_observer(self._on_step)
        except ValueError:
            pass  # already detached


def held_blocks(snap) -> int:
    """GPU blocks held after an engine step (its ``StepSnapshot``)."""
    sched = snap.scheduler
    return sched["num_gpu_blocks"] - sched["num_free_gpu_blocks"]
