"""What the live page sees of the engine: the latest step, thinned and drawn, never slowing a step
(lesson 13; the page and its routes are ``live_routes.py``).

    event loop:    each open stream wakes every ``interval`` s and asks for a snapshot (one
                   request at a time for all streams); if a step happened since its last frame,
                   it sends the newest frame: built (and drawn) once per snapshot, shared by
                   every stream, in a worker thread
    engine thread: between two steps it answers: an observer for the next step only (the step
                   as ``StepSnapshot``), or the state now when no step is coming

So the engine builds at most 1 / interval snapshots a second, however fast it steps (a
snapshot reads every block of both pools: one per step would cost a small model most of its
speed), spaced so that snapshots, frames and drawings take at most ``SHARE`` (5 %) of the time
(a drawing of many sequences takes a tenth of a second), and none without an open page; a step never waits for a browser: a slow client skips
what it had no time for (it gets the latest, not a backlog). The page's log still counts every
preemption and copy, from the stats.

The page keeps the server's exposure rules: a frame holds token counts, block numbers and
request ids, never the text of a request or its token ids, unless the server was started with
``--live-show-text``; at most ``max_streams`` streams are open at once.
"""
from __future__ import annotations

import asyncio
import collections
import importlib
import json
import time
from dataclasses import dataclass
from typing import Callable

from minipaged.engine.async_llm_engine import AsyncLLMEngine
from minipaged.engine.llm_engine import LLMEngine
from minipaged.engine.stats import StepSnapshot

DRAWING_MODULE = "visualizer.live_page"


def visualizer_drawing() -> Callable[[dict], dict] | None:
    """The lessons' drawing of a frame (``visualizer.live_page.draw_frame``), or None when the
    ``visualizer`` package is absent (the page then lists the blocks as text).

    NOTE: found by name at start-up, not imported: the visualizer sits above every layer of
    the engine (docs/ARCHITECTURE.md), and the server only passes it plain data."""
    try:
        return importlib.import_module(DRAWING_MODULE).draw_frame
    except ImportError:
        return None


@dataclass(frozen=True)
class LiveOptions:
    """The live page's settings (``minipaged serve`` flags).

    Args:
        draw: frame -> {"blocks": svg, "queues": svg}; None: ``visualizer_drawing()``.
        show_text: put each sequence's text in the frames (off: token counts only).
        max_streams: the most event streams open at once; one more gets 503.
        interval: seconds between two frames of one stream (at most 1 / interval a second).
    """

    draw: Callable[[dict], dict] | None = None
    show_text: bool = False
    max_streams: int = 4
    interval: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.max_streams, int) or self.max_streams < 1:
            raise ValueError(f"max_live_streams must be an integer >= 1, got "
                             f"{self.max_streams!r}")
        if not isinstance(self.interval, (int, float)) or not 0 < self.interval <= 10:
            raise ValueError(f"interval must be a number of seconds in (0, 10], got "
                             f"{self.interval!r}")


EVENTS_KEPT = 30  # preemptions and copies the page's log may still fetch
# The page's work (the engine's snapshot, then building and drawing the frame) takes at most this
# share of the time: the next snapshot is asked for no sooner than the last one's cost / SHARE.
SHARE = 0.05
COUNTED = ("num_preemptions_recompute", "num_preemptions_swap", "num_blocks_copied",
           "num_blocks_swapped_out")


class LiveFeed:
    """The latest step of ``async_engine``'s engine, as frames for the page's event streams.

    Args:
        async_engine: the served engine; the feed reaches it only through its engine thread.
        options: ``LiveOptions``.
    """

    def __init__(self, async_engine: AsyncLLMEngine, options: LiveOptions | None = None) -> None:
        self.async_engine = async_engine
        self.options = options = options or LiveOptions()
        self.draw = options.draw or visualizer_drawing()
        self.num_streams = 0
        self._latest: StepSnapshot | None = None  # written by the engine thread only
        self._version = 0  # steps seen (engine thread), so streams know when to send
        self._events: collections.deque = collections.deque(maxlen=EVENTS_KEPT)
        self._pending = False  # a snapshot was asked of the engine thread
        self._armed = False  # (engine thread) _observe_once waits for the next step
        self._snapshot_cost = 0.0  # seconds the engine took for the last snapshot
        self._next_at = 0.0  # (time.monotonic()) no snapshot is asked for before this
        self._counts: dict | None = None  # COUNTED at the last snapshot
        self._kept_paused = False  # whether the engine was paused at the last snapshot
        self._frame: tuple[int, str] = (-1, "")  # (version, JSON) of the last frame built
        self._build_lock = asyncio.Lock()
        self._rate: tuple[float, int] | None = None  # (time, tokens) when the last frame built
        # True once the HTTP server is shutting down: the streams end, so that they never hold
        # its shutdown (``api_server.py`` sets it to read uvicorn's flag)
        self.stopping: Callable[[], bool] = lambda: False

    # -- the engine thread -----------------------------------------------------------------------
    def _arm(self, engine: LLMEngine) -> None:
        """Between two steps: watch the next step, or (no step coming) take the state now."""
        if engine.has_unfinished_requests() and not self.async_engine.paused:
            if not self._armed:
                self._armed = True
                engine.add_observer(self._observe_once)
            return
        if (self._latest is None or self._latest.step != engine.stats.num_steps
                or self._kept_paused != self.async_engine.paused):  # (the page shows Pause)
            started = time.perf_counter()
            snap = _snapshot_now(engine)
            self._snapshot_cost = time.perf_counter() - started
            self._keep(snap)
        self._pending = False

    def _observe_once(self, snap: StepSnapshot) -> None:
        """An observer for one step only: it removes itself at once."""
        self.async_engine.engine.remove_observer(self._observe_once)
        self._armed = False
        # (the engine built the snapshot between the step's end and this call)
        self._snapshot_cost = time.perf_counter() - snap.times[-1] if snap.times else 0.0
        self._keep(snap)
        self._pending = False

    def _keep(self, snap: StepSnapshot) -> None:
        """Keep the newest snapshot; the preemptions and copies since the last one go to the
        page's log (counted from the stats, so the steps no frame showed are counted too)."""
        counts = {k: snap.stats.get(k, 0) for k in COUNTED}
        if self._counts is not None:
            new = {k: v - self._counts[k] for k, v in counts.items() if v > self._counts[k]}
            if new:
                self._events.append({"step": snap.step, "since": self._latest.step,
                                     "preempted": [list(p) for p in snap.preempted], **new})
        self._counts = counts
        self._kept_paused = self.async_engine.paused
        self._latest = snap
        self._version += 1

    def _detach(self, engine: LLMEngine) -> None:
        if self._armed:
            self._armed = False
            engine.remove_observer(self._observe_once)
        self._pending = False
        # NOTE: a page that paused the engine and went away must not leave it paused
        self.async_engine.resume()

    # -- the streams (event loop) ----------------------------------------------------------------
    def open_stream(self) -> bool:
        """Count one more stream; False (nothing counted) when ``max_streams`` are open."""
        if self.num_streams >= self.options.max_streams:
            return False
        self.num_streams += 1
        return True

    def close_stream(self) -> None:
        self.num_streams -= 1
        if self.num_streams == 0:
            self.async_engine.call_in_engine_thread(self._detach)

    def _want_frame(self) -> None:
        """Ask the engine thread for a snapshot, unless one is asked for already."""
        if not self._pending and time.monotonic() >= self._next_at:
            self._pending = True
            self.async_engine.call_in_engine_thread(self._arm)

    async def frames(self, is_disconnected: Callable):
        """Server-sent events: the newest frame whenever a step happened since the last one, a
        comment every 15 s otherwise; ends when the client goes away or the server stops. Opened
        by the caller
        (``open_stream``), closed here."""
        sent, quiet_since = -1, time.monotonic()
        try:
            while not self.stopping() and not await is_disconnected():
                if self.async_engine.error is not None:  # the engine loop died: say why, end
                    yield f"event: error\ndata: {json.dumps(str(self.async_engine.error))}\n\n"
                    return
                self._want_frame()
                version, payload = await self.latest_frame()
                if version != sent and payload:
                    sent, quiet_since = version, time.monotonic()
                    yield f"event: frame\ndata: {payload}\n\n"
                elif time.monotonic() - quiet_since > 15:
                    quiet_since = time.monotonic()
                    yield ": idle\n\n"
                await asyncio.sleep(self.options.interval)
        finally:
            self.close_stream()

    async def latest_frame(self) -> tuple[int, str]:
        """(version, JSON) of the newest step, built at most once per version for all streams."""
        async with self._build_lock:
            version, snap = self._version, self._latest
            if snap is not None and version != self._frame[0]:
                payload = await asyncio.to_thread(self._build, snap, version)
                self._frame = (version, payload)
            return self._frame

    def _build(self, snap: StepSnapshot, version: int) -> str:
        started = time.thread_time()  # (this thread's own time: a busy machine does not count)
        payload = json.dumps(self.frame_of(snap, version), separators=(",", ":"))
        cost = self._snapshot_cost + time.thread_time() - started
        self._next_at = time.monotonic() + cost / SHARE
        return payload

    def frame_of(self, snap: StepSnapshot, version: int = 0) -> dict:
        """One step as the page gets it: plain numbers, no request text unless ``show_text``."""
        bm, sched = snap.block_manager, snap.scheduler
        blocks = thinned_blocks(bm, self.options.show_text)
        gpu = bm.get("gpu_blocks", [])
        now, tokens = time.monotonic(), snap.stats.get("num_sampled_tokens", 0)
        rate = 0.0
        if self._rate is not None and now > self._rate[0] and tokens >= self._rate[1]:
            rate = (tokens - self._rate[1]) / (now - self._rate[0])
        self._rate = (now, tokens)
        step = {"step": snap.step, "scheduled": snap.scheduled, "prompt_run": snap.prompt_run,
                "preempted": [list(p) for p in snap.preempted], "finished": snap.finished,
                "blocks_to_copy": snap.blocks_to_copy, "blocks_to_swap_in": snap.blocks_to_swap_in,
                "blocks_to_swap_out": snap.blocks_to_swap_out}
        frame = {
            "version": version, **step,
            "num_batched_tokens": snap.num_batched_tokens,
            "queues": {q: [{k: b[k] for k in ("request_id", "num_seqs", "num_tokens")}
                           for b in sched.get(q, [])] for q in ("waiting", "running", "swapped")},
            "pool": {"total": len(gpu), "free": len(bm.get("free_gpu_blocks", [])),
                     "held": sum(b["ref_count"] > 0 for b in gpu),
                     "shared": sum(b["ref_count"] > 1 for b in gpu),
                     "cached": sum(bool(b.get("cached")) for b in gpu),
                     "evictable": sum(bool(b.get("evictable")) for b in gpu),
                     "cpu_total": len(bm.get("cpu_blocks", [])),
                     "cpu_free": len(bm.get("free_cpu_blocks", []))},
            "tables": [{k: s[k] for k in ("seq_id", "request_id", "status", "device",
                                          "num_tokens", "block_table")}
                       for s in blocks.get("sequences", [])],
            "stats": {k: snap.stats.get(k, 0) for k in (
                "num_steps", "num_preemptions_recompute", "num_preemptions_swap",
                "num_blocks_copied", "num_sampled_tokens", "num_prompt_tokens")},
            "tokens_per_s": round(rate, 1),
            "paused": self.async_engine.paused,
            "events": list(self._events),
            "show_text": self.options.show_text,
        }
        if self.options.show_text:
            frame["text"] = self._texts(bm)
        if self.draw is not None and blocks:
            frame["svg"] = self.draw({"block_manager": blocks, "scheduler": sched, "step": step})
        return frame

    def _texts(self, bm: dict) -> dict[str, str]:
        tokenizer = self.async_engine.engine.tokenizer  # (read-only: fixed at start-up)
        texts = {}
        for s in bm.get("sequences", []):
            ids = [t for lb in s["logical_blocks"] for t in lb.get("token_ids", [])]
            texts[str(s["seq_id"])] = (tokenizer.decode(ids) if tokenizer is not None
                                       else " ".join(map(str, ids)))
        return texts


def thinned_blocks(bm: dict, show_text: bool) -> dict:
    """The block manager's snapshot without the tokens' ids (unless ``show_text``): what a
    sequence holds is shown by counts (filled slots), never by its content."""
    if show_text or not bm:
        return bm
    sequences = [{**s, "logical_blocks": [{"index": lb["index"], "num_filled": lb["num_filled"],
                                           "token_ids": []} for lb in s["logical_blocks"]]}
                 for s in bm.get("sequences", [])]
    return {**bm, "sequences": sequences}


def _snapshot_now(engine: LLMEngine) -> StepSnapshot:
    """The engine's state between steps, as a snapshot of no step (the engine thread only)."""
    return StepSnapshot(step=engine.stats.num_steps, scheduled=[], prompt_run=[],
                        blocks_to_swap_in={}, blocks_to_swap_out={}, blocks_to_copy={},
                        preempted=[], finished=[],
                        block_manager=engine.scheduler.block_snapshot(),
                        scheduler=engine.scheduler.snapshot(), stats=engine.stats.as_dict())
