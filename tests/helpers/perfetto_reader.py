"""A reader of a Perfetto protobuf trace for the tests: parsed by the `perfetto` package's own
definitions (``perfetto_trace_pb2.Trace``), never by ``minipaged/engine/perfetto_trace.py``'s.

Its slices are rebuilt as a viewer rebuilds them: each track's events sorted by timestamp (in
file order at one timestamp), a TYPE_SLICE_BEGIN opening a slice and a TYPE_SLICE_END closing the
innermost open one. What it returns has the shape of ``trace_reader.tracks`` (times in
microseconds), so the same checks read both formats.
"""
from __future__ import annotations

from collections import defaultdict

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TracePacket, TrackEvent


def read_packets(path) -> list:
    trace = Trace()
    with open(path, "rb") as f:
        trace.ParseFromString(f.read())
    packets = list(trace.packet)
    assert packets, "an empty trace"
    assert packets[0].sequence_flags & TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    assert len({p.trusted_packet_sequence_id for p in packets}) == 1
    return packets


def _args(event) -> dict:
    out = {}
    for a in event.debug_annotations:
        out[a.name] = getattr(a, a.WhichOneof("value"))
    return out


def _slices(timed: list) -> list[dict]:
    """One track's (timestamp, TrackEvent)s -> its slices and instants, by start."""
    out, open_ = [], []
    for ts, event in sorted(timed, key=lambda item: item[0]):
        us = ts / 1000
        if event.type == TrackEvent.TYPE_SLICE_BEGIN:
            open_.append({"name": event.name, "ph": "X", "ts": us, "args": _args(event)})
            out.append(open_[-1])
        elif event.type == TrackEvent.TYPE_SLICE_END:
            assert open_, f"a slice ends at {us} with none open"
            begun = open_.pop()
            begun["dur"] = us - begun["ts"]
        elif event.type == TrackEvent.TYPE_INSTANT:
            out.append({"name": event.name, "ph": "i", "ts": us, "args": _args(event)})
        else:
            raise AssertionError(f"unexpected event type {event.type} on a slice track")
    assert not open_, f"slices never ended: {[s['name'] for s in open_]}"
    return sorted(out, key=lambda e: e["ts"])


def perfetto_tracks(path) -> tuple[list[dict], dict[str, list[dict]], dict[str, list]]:
    """(the engine's "steps" thread's slices, each request's events by id, counter track name
    -> its values in time order)."""
    tracks, timed = {}, defaultdict(list)
    for packet in read_packets(path):
        if packet.HasField("track_descriptor"):
            tracks[packet.track_descriptor.uuid] = packet.track_descriptor
        elif packet.HasField("track_event"):
            event = packet.track_event
            assert event.track_uuid in tracks, "an event before its track's descriptor"
            timed[event.track_uuid].append((packet.timestamp, event))
    processes = {t.process.process_name: t for t in tracks.values() if t.HasField("process")}
    engine, requests = processes["engine"], processes["requests"]
    steps = next(t for t in tracks.values() if t.HasField("thread")
                 and t.thread.pid == engine.process.pid and t.thread.thread_name == "steps")
    per_request = {t.name.removeprefix("request "): _slices(timed[uuid])
                   for uuid, t in tracks.items()
                   if t.parent_uuid == requests.uuid and t.name.startswith("request ")}
    counters = {}
    for uuid, t in tracks.items():
        if t.HasField("counter"):
            assert t.parent_uuid == engine.uuid
            values = sorted(timed[uuid], key=lambda item: item[0])
            assert all(e.type == TrackEvent.TYPE_COUNTER for _, e in values)
            counters[t.name] = [e.double_counter_value for _, e in values]
    return _slices(timed[steps.uuid]), per_request, counters
