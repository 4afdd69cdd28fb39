"""The engine's steps as a Chrome trace-event file, for Perfetto and chrome://tracing (lesson 15).

``LLMEngine(trace_path="steps.json")`` (``minipaged serve --trace steps.json``) registers a
``StepTrace`` as an observer. After every step it appends, in the trace-event format's JSON
array form (https://ui.perfetto.dev opens it; so does chrome://tracing):

    process "engine", thread "steps"   a slice per step ("step N") and inside it one per phase:
                                       schedule, prepare, model, sample, update
    process "engine", counters         "KV blocks" (free, used), "sequences" (running, waiting,
                                       swapped), "batched tokens" (tokens)
    process "requests", a thread each  "waiting" (arrival to first run), "prefill" (one slice
                                       per chunk's step), "decode" (consecutive decode steps as
                                       one slice), "preempted (recompute)" / "swapped" (until it
                                       runs again), and an instant "finished"

A path ending in ``.perfetto-trace`` or ``.pftrace`` gets the same events in Perfetto's own
protobuf format instead (``perfetto_trace.py``).

Times are microseconds of ``time.perf_counter()``, the clock of the step's phases
(``StepSnapshot.times``); arrivals (``time.monotonic()``) are moved onto it once, at start.
NOTE: each step's events are written and flushed when the step ends, without the closing
bracket: the format lets a trace end without it, so a server killed mid-run leaves a file the
viewers still open. ``close()`` (``LLMEngine.shutdown()``, or at exit) writes the bracket.
"""
from __future__ import annotations

import atexit
import json
import time

from minipaged.engine.perfetto_trace import SUFFIXES, PerfettoEncoder
from minipaged.engine.stats import StepSnapshot

PHASES = ("schedule", "prepare", "model", "sample", "update")
ENGINE_PID, REQUESTS_PID, STEPS_TID = 1, 2, 1


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


class StepTrace:
    """An observer writing each step to ``path`` as trace events (see the module's docstring).

    Args:
        path: the file to write (replaced if it exists): JSON, or Perfetto's protobuf format
            when it ends in ``.perfetto-trace`` or ``.pftrace``.

    Raises:
        ValueError: the file cannot be opened for writing (naming ``trace_path``).
    """

    def __init__(self, path: str) -> None:
        self._proto = PerfettoEncoder() if path.endswith(SUFFIXES) else None
        try:
            self._file = open(path, "wb") if self._proto else open(path, "w", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"trace_path: cannot write the trace to {path!r}: {e}") from None
        self.path = path
        self.num_events = 0
        # monotonic() -> perf_counter(): arrivals are read on the first, phases on the second
        self._offset = time.perf_counter() - time.monotonic()
        self._tids: dict[str, int] = {}  # request id -> its thread in the "requests" process
        self._started: set[str] = set()  # requests that have run at least once
        self._decode: dict[str, list] = {}  # request id -> [start us, end us, steps, last step]
        self._paused: dict[str, tuple[str, float]] = {}  # preempted: (slice name, since us)
        self._write([
            {"name": "process_name", "ph": "M", "pid": ENGINE_PID, "args": {"name": "engine"}},
            {"name": "thread_name", "ph": "M", "pid": ENGINE_PID, "tid": STEPS_TID,
             "args": {"name": "steps"}},
            {"name": "process_name", "ph": "M", "pid": REQUESTS_PID,
             "args": {"name": "requests"}},
        ])
        atexit.register(self.close)

    @property
    def closed(self) -> bool:
        return self._file.closed

    def __call__(self, snap: StepSnapshot) -> None:
        """Write one step (the engine calls this after every step)."""
        if self.closed or len(snap.times) < 6:
            return
        t = [_us(x) for x in snap.times]
        start, end = t[0], t[-1]
        events = [self._slice(f"step {snap.step}", ENGINE_PID, STEPS_TID, start, end,
                              {"scheduled": len(snap.scheduled),
                               "batched_tokens": snap.num_batched_tokens,
                               "preempted": len(snap.preempted)})]
        events += [self._slice(name, ENGINE_PID, STEPS_TID, t[i], t[i + 1])
                   for i, name in enumerate(PHASES)]
        events += self._counters(snap, end)
        events += self._requests(snap, start, end)
        self._write(events)

    def close(self) -> None:
        """Close any open request slices and the JSON array; a second call does nothing."""
        if self.closed:
            return
        end = _us(time.perf_counter())
        events = [self._decode_slice(rid) for rid in list(self._decode)]
        events += [self._slice(name, REQUESTS_PID, self._tids[rid], since, end)
                   for rid, (name, since) in self._paused.items()]
        self._paused.clear()
        self._write(events)
        if self._proto is None:
            self._file.write("\n]\n")
        self._file.close()
        atexit.unregister(self.close)

    # -- what one step writes --------------------------------------------------------------------
    @staticmethod
    def _slice(name: str, pid: int, tid: int, start: float, end: float,
               args: dict | None = None) -> dict:
        event = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start,
                 "dur": round(max(end - start, 0.0), 3)}
        if args:
            event["args"] = args
        return event

    @staticmethod
    def _counters(snap: StepSnapshot, ts: float) -> list[dict]:
        s = snap.scheduler
        free = s.get("num_free_gpu_blocks", 0)
        counters = {
            "KV blocks": {"free": free, "used": s.get("num_gpu_blocks", 0) - free},
            "sequences": {q: sum(b["num_unfinished"] for b in s.get(q, []))
                          for q in ("running", "waiting", "swapped")},
            "batched tokens": {"tokens": snap.num_batched_tokens},
        }
        return [{"name": name, "ph": "C", "pid": ENGINE_PID, "ts": ts, "args": args}
                for name, args in counters.items()]

    def _tid(self, request_id: str, events: list[dict]) -> int:
        tid = self._tids.get(request_id)
        if tid is None:
            tid = self._tids[request_id] = len(self._tids) + 1
            events.append({"name": "thread_name", "ph": "M", "pid": REQUESTS_PID, "tid": tid,
                           "args": {"name": f"request {request_id}"}})
        return tid

    def _decode_slice(self, request_id: str) -> dict:
        start, end, steps, _ = self._decode.pop(request_id)
        return self._slice("decode", REQUESTS_PID, self._tids[request_id], start, end,
                           {"steps": steps})

    def _requests(self, snap: StepSnapshot, start: float, end: float) -> list[dict]:
        events: list[dict] = []
        for request_id, prompt_run in zip(snap.scheduled, snap.prompt_run):
            tid = self._tid(request_id, events)
            if request_id not in self._started:
                self._started.add(request_id)
                arrival = snap.arrival_times.get(request_id)
                if arrival is not None:
                    events.append(self._slice("waiting", REQUESTS_PID, tid,
                                              _us(arrival + self._offset), start))
            if request_id in self._paused:
                name, since = self._paused.pop(request_id)
                events.append(self._slice(name, REQUESTS_PID, tid, since, start))
            if prompt_run:
                if request_id in self._decode:
                    events.append(self._decode_slice(request_id))
                events.append(self._slice("prefill", REQUESTS_PID, tid, start, end,
                                          {"step": snap.step}))
                continue
            run = self._decode.get(request_id)
            if run is not None and run[3] == snap.step - 1:
                run[1], run[2], run[3] = end, run[2] + 1, snap.step
            else:
                if run is not None:
                    events.append(self._decode_slice(request_id))
                self._decode[request_id] = [start, end, 1, snap.step]
        for request_id, mode in snap.preempted:
            tid = self._tid(request_id, events)
            if request_id in self._decode:
                events.append(self._decode_slice(request_id))
            name = "swapped" if mode == "swap" else f"preempted ({mode})"
            self._paused[request_id] = (name, end)
            events.append({"name": "preempted", "ph": "i", "s": "t", "pid": REQUESTS_PID,
                           "tid": tid, "ts": start, "args": {"mode": mode}})
        for request_id in snap.finished:
            tid = self._tid(request_id, events)
            if request_id in self._decode:
                events.append(self._decode_slice(request_id))
            if request_id in self._paused:
                name, since = self._paused.pop(request_id)
                events.append(self._slice(name, REQUESTS_PID, tid, since, end))
            events.append({"name": "finished", "ph": "i", "s": "t", "pid": REQUESTS_PID,
                           "tid": tid, "ts": end})
        return events

    def _write(self, events: list[dict]) -> None:
        if not events:
            return
        if self._proto is not None:
            self._file.write(self._proto.encode(events))
            self._file.flush()
            self.num_events += len(events)
            return
        sep = "[\n" if self.num_events == 0 else ",\n"
        self._file.write(sep + ",\n".join(json.dumps(e, separators=(",", ":"))
                                          for e in events))
        self._file.flush()
        self.num_events += len(events)
