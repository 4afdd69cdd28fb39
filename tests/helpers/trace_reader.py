"""A reader of Chrome trace-event JSON written for the tests from the format's documentation,
independent of ``minipaged/engine/step_trace.py``.

NOTE: the `perfetto` package's trace processor would be a reader that is not ours, but it
downloads its binary on first use, which machines without internet cannot. This reader checks
every event against the format's rules (the Trace Event Format document: "ph" is the phase,
X a complete slice with "ts" and "dur" in microseconds, i an instant with scope "s", C a counter
whose "args" are numbers, M metadata naming a process or thread; "pid"/"tid" place it).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict


def read_trace(path, closed: bool = True) -> list[dict]:
    """The events of a JSON-array trace, each checked against the format's required fields.

    ``closed=False`` reads a trace still being written: the format allows the final ``]`` to be
    missing."""
    text = open(path, encoding="utf-8").read()
    if not closed:
        assert not text.rstrip().endswith("]")
        text = text.rstrip().rstrip(",") + "]"
    events = json.loads(text)
    assert isinstance(events, list)
    for e in events:
        assert isinstance(e.get("name"), str) and e["name"], e
        assert isinstance(e.get("pid"), int), e
        ph = e["ph"]
        if ph == "M":
            assert e["name"] in ("process_name", "thread_name") and "name" in e["args"], e
            assert e["name"] == "process_name" or isinstance(e.get("tid"), int), e
            continue
        assert isinstance(e["ts"], (int, float)) and math.isfinite(e["ts"]), e
        if ph == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0, e
        elif ph == "i":
            assert e.get("s", "t") in ("g", "p", "t") and isinstance(e["tid"], int), e
        elif ph == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        else:
            raise AssertionError(f"unexpected phase {ph!r}: {e}")
    return events


def names_of(events, kind: str) -> dict[tuple, str]:
    """(pid,) or (pid, tid) -> the name its metadata event gives."""
    return {(e["pid"],) if kind == "process_name" else (e["pid"], e["tid"]): e["args"]["name"]
            for e in events if e["ph"] == "M" and e["name"] == kind}


def tracks(events) -> tuple[list[dict], dict[str, list[dict]], list[dict]]:
    """(the engine's step-thread slices, each request's events by id, the counters)."""
    processes = {v: k[0] for k, v in names_of(events, "process_name").items()}
    threads = names_of(events, "thread_name")
    engine, requests = processes["engine"], processes["requests"]
    steps_tid = next(tid for (pid, tid), n in threads.items() if pid == engine and n == "steps")
    steps = [e for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == (engine, steps_tid)]
    per_request = defaultdict(list)
    for e in events:
        if e["ph"] in ("X", "i") and e["pid"] == requests:
            per_request[threads[(requests, e["tid"])].removeprefix("request ")].append(e)
    counters = [e for e in events if e["ph"] == "C" and e["pid"] == engine]
    return steps, per_request, counters
