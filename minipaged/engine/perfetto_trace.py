"""The step trace in Perfetto's own protobuf format (a ``trace_path`` ending in
``.perfetto-trace`` or ``.pftrace``): the events of the JSON form (``step_trace.py``) encoded as
``TrackEvent`` packets, which Perfetto's UI and trace processor read natively.

The encoder is a small one of our own: protobuf's wire format is varints (7 bits a byte, the high
bit set on all but the last), little-endian doubles, and length-prefixed bytes, each after a key
``field number << 3 | wire type``. The field numbers below are those of Perfetto's trace protos
(``trace.proto``, ``trace_packet.proto``, ``track_event.proto``, ``track_descriptor.proto``,
``debug_annotation.proto``). A trace file is a ``Trace`` message: nothing but its field 1, one
``TracePacket`` after another, so a file cut after any packet is a whole trace (a server killed
mid-run leaves one Perfetto opens; nothing needs closing).

How the JSON events map:

    "M" process_name    a track with a ProcessDescriptor (pid, name)
    "M" thread_name     the engine's "steps": a track with a ThreadDescriptor (pid, tid, name);
                        "request N": a track of that name under the "requests" process
    "X" slice           TYPE_SLICE_BEGIN at ts, TYPE_SLICE_END at ts + dur, on its track
    "i" instant         TYPE_INSTANT
    "C" counter         a counter track per series ("KV blocks free", "KV blocks used",
                        "sequences running", ..., "batched tokens"), TYPE_COUNTER values
    "args"              debug annotations (an int, a double or a string each)

Timestamps are nanoseconds. Within one step's events, the packets are sorted as the viewers
nest them: at one instant, slices end before others begin, an inner slice ends before its outer
one, an outer slice begins before its inner ones.
"""
from __future__ import annotations

import struct

SUFFIXES = (".perfetto-trace", ".pftrace")

# field numbers of Perfetto's trace protos
TRACE_PACKET = 1                                   # Trace.packet
TIMESTAMP, SEQUENCE_ID, TRACK_EVENT, SEQUENCE_FLAGS, TRACK_DESCRIPTOR = 8, 10, 11, 13, 60
EVENT_ANNOTATIONS, EVENT_TYPE, EVENT_TRACK, EVENT_NAME, EVENT_DOUBLE_VALUE = 4, 9, 11, 23, 44
TRACK_UUID, TRACK_NAME, TRACK_PROCESS, TRACK_THREAD, TRACK_PARENT, TRACK_COUNTER = 1, 2, 3, 4, 5, 8
PROCESS_PID, PROCESS_NAME = 1, 6
THREAD_PID, THREAD_TID, THREAD_NAME = 1, 2, 5
ANNOTATION_INT, ANNOTATION_DOUBLE, ANNOTATION_STRING, ANNOTATION_NAME = 4, 5, 6, 10
SLICE_BEGIN, SLICE_END, INSTANT, COUNTER = 1, 2, 3, 4  # TrackEvent.Type
INCREMENTAL_STATE_CLEARED, NEEDS_INCREMENTAL_STATE = 1, 2  # TracePacket.SequenceFlags
SEQUENCE = 1  # the one writer's trusted_packet_sequence_id


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # (int64 as protobuf writes a negative one: ten bytes)
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _double(field: int, value: float) -> bytes:
    return _varint(field << 3 | 1) + struct.pack("<d", value)


def _bytes(field: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _annotation(name: str, value) -> bytes:
    if isinstance(value, bool) or isinstance(value, int):
        body = _int(ANNOTATION_INT, int(value))
    elif isinstance(value, float):
        body = _double(ANNOTATION_DOUBLE, value)
    else:
        body = _bytes(ANNOTATION_STRING, str(value))
    return _bytes(ANNOTATION_NAME, name) + body


def _ns(us: float) -> int:
    return round(us * 1000)


class PerfettoEncoder:
    """Trace events (the JSON form's dicts) -> the bytes of their ``TracePacket``s."""

    def __init__(self) -> None:
        self._tracks: dict[tuple, int] = {}  # ("process", pid) / ("thread", pid, tid) /
        # ("counter", name) -> its track's uuid
        self._first = True

    def encode(self, events: list[dict]) -> bytes:
        descriptors, timed = [], []
        for order, e in enumerate(events):
            ph = e["ph"]
            if ph == "M":
                descriptors.append(self._descriptor(e))
            elif ph == "X":
                track, args = self._tracks[("thread", e["pid"], e["tid"])], e.get("args")
                start, end = _ns(e["ts"]), _ns(e["ts"] + e["dur"])
                timed.append(((start, 2, start - end, order),
                              self._event(SLICE_BEGIN, track, start, e["name"], args)))
                timed.append(((end, 0, end - start, -order),
                              self._event(SLICE_END, track, end)))
            elif ph == "i":
                track = self._tracks[("thread", e["pid"], e["tid"])]
                timed.append(((_ns(e["ts"]), 1, 0, order),
                              self._event(INSTANT, track, _ns(e["ts"]), e["name"], e.get("args"))))
            elif ph == "C":
                for key, value in e["args"].items():
                    name = f"{e['name']} {key}" if len(e["args"]) > 1 else e["name"]
                    track, new = self._counter(name, e["pid"])
                    descriptors += new
                    timed.append(((_ns(e["ts"]), 1, 0, order),
                                  self._event(COUNTER, track, _ns(e["ts"]), value=float(value))))
            else:
                raise ValueError(f"no Perfetto packet for a trace event of phase {ph!r}")
        timed.sort(key=lambda item: item[0])
        return b"".join(descriptors) + b"".join(packet for _, packet in timed)

    # -- packets -------------------------------------------------------------------------------
    def _packet(self, body: bytes, flags: int = 0) -> bytes:
        if self._first:  # the sequence starts with its (empty) incremental state cleared
            flags |= INCREMENTAL_STATE_CLEARED
            self._first = False
        body = _int(SEQUENCE_ID, SEQUENCE) + body
        if flags:
            body += _int(SEQUENCE_FLAGS, flags)
        return _bytes(TRACE_PACKET, body)

    def _event(self, kind: int, track: int, ts: int, name: str | None = None,
               args: dict | None = None, value: float | None = None) -> bytes:
        event = _int(EVENT_TYPE, kind) + _int(EVENT_TRACK, track)
        if name is not None:
            event += _bytes(EVENT_NAME, name)
        for key, arg in (args or {}).items():
            event += _bytes(EVENT_ANNOTATIONS, _annotation(key, arg))
        if value is not None:
            event += _double(EVENT_DOUBLE_VALUE, value)
        return self._packet(_int(TIMESTAMP, ts) + _bytes(TRACK_EVENT, event),
                            NEEDS_INCREMENTAL_STATE)

    def _new_track(self, key: tuple, body: bytes) -> bytes:
        uuid = self._tracks[key] = len(self._tracks) + 1
        return self._packet(_bytes(TRACK_DESCRIPTOR, _int(TRACK_UUID, uuid) + body))

    def _descriptor(self, e: dict) -> bytes:
        pid, name = e["pid"], e["args"]["name"]
        if e["name"] == "process_name":
            return self._new_track(("process", pid), _bytes(
                TRACK_PROCESS, _int(PROCESS_PID, pid) + _bytes(PROCESS_NAME, name)))
        if name.startswith("request "):  # a track of the process (a request is no OS thread)
            return self._new_track(("thread", pid, e["tid"]), _bytes(TRACK_NAME, name)
                                   + _int(TRACK_PARENT, self._tracks[("process", pid)]))
        return self._new_track(("thread", pid, e["tid"]), _bytes(
            TRACK_THREAD, _int(THREAD_PID, pid) + _int(THREAD_TID, e["tid"])
            + _bytes(THREAD_NAME, name)))

    def _counter(self, name: str, pid: int) -> tuple[int, list[bytes]]:
        key = ("counter", name)
        if key in self._tracks:
            return self._tracks[key], []
        packet = self._new_track(key, _bytes(TRACK_NAME, name) + _bytes(TRACK_COUNTER, b"")
                                 + _int(TRACK_PARENT, self._tracks[("process", pid)]))
        return self._tracks[key], [packet]
