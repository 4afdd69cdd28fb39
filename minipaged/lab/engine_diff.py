"""Two engines on one workload, step by step: the first step and field that differ (lesson 19).

    run_a = record(reference, workload)       # steps an engine through the workload, keeps
    run_b = record(suspect, workload)         # every step's plain data (and its logits)
    found = compare(run_a, run_b)             # None, or the first Difference: step and field
    print(found)

``record`` adds each ``Request`` before the step it arrives at, aborts those that say so, steps the
engine until every request is done, and keeps after every step, as plain data:

- ``schedule``: what the scheduler decided (groups run, preemptions, the cache moves);
- ``inputs``: the flat batch the model got (token ids, positions, slots, block tables, context
  lengths), read from ``engine.worker.execute_model``'s argument;
- ``logits``: what the model returned, row by row (compared within a tolerance);
- ``sequences``: each sequence's tokens, status and computed tokens;
- ``blocks``: the block tables, ref counts and free lists; ``queues``; ``outputs``: what
  ``step()`` returned.

``compare`` walks both recordings a step at a time and a step's fields in that order, the order
one step makes them, so the first difference it names is the earliest thing that went wrong:
inputs that differ while the schedule agrees point at what builds the batch; logits that differ
while the inputs agree point at the model or its attention; a crash is a difference too.
Under the difference, the GPU blocks the two engines hold differently after that step
(``block_evidence.py``): evidence, not a verdict.

Any engine with the ``LLMEngine`` interface can be recorded (``add_request``, ``abort_request``,
``step``, ``add_observer``, ``scheduler``, ``worker``). Sequences are named by request and place in
their group, not by sequence id, so engines that number sequences differently still compare.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from minipaged.lab.block_evidence import SHOWN_BLOCKS, blocks_that_differ
from minipaged.sampling_params import SamplingParams

# The groups of a step's fields, in the order a step makes them.
FIELD_GROUPS = ("error", "schedule", "inputs", "logits", "sequences", "blocks", "queues",
                "outputs")


class Request(NamedTuple):
    """One request of a workload.

    Args:
        prompt_token_ids: the prompt.
        params: how to sample.
        arrive_at_step: added before step ``arrive_at_step + 1`` (0: before the first step).
        abort_at_step: aborted after that step, before the next (None: runs to its end).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    arrive_at_step: int = 0
    abort_at_step: int | None = None


@dataclass
class StepRecord:
    """One step of a recording: ``fields`` maps a group of ``FIELD_GROUPS`` to {name: value}."""

    step: int
    fields: dict[str, dict[str, object]]
    logits: list[tuple[list[str], torch.Tensor]] = field(default_factory=list)  # per model call
    snapshot: object = None  # the observers' StepSnapshot (None if the step crashed)
    error: str | None = None  # "ValueError: ..." if the step raised


@dataclass
class Recording:
    """An engine's run of a workload: its steps, its final outputs, and its crash if it had one."""

    workload: list[Request]
    steps: list[StepRecord] = field(default_factory=list)
    outputs: dict[str, object] = field(default_factory=dict)  # request id -> last RequestOutput
    error: str | None = None  # the crash (or "unfinished after N steps")

    @property
    def snapshots(self) -> list:
        """The observers' ``StepSnapshot`` of every step that finished (for ``StepPlayer``)."""
        return [s.snapshot for s in self.steps if s.snapshot is not None]

    def snapshots_around(self, step: int, before: int = 2, after: int = 1) -> list:
        """The snapshots of steps ``step - before`` to ``step + after``."""
        return [s.snapshot for s in self.steps
                if s.snapshot is not None and step - before <= s.step <= step + after]

    def texts(self) -> dict[str, list[str]]:
        """Request id -> the text of each of its completions."""
        return {rid: [c.text for c in out.outputs] for rid, out in self.outputs.items()}

    def free_gpu_blocks(self) -> list[tuple[int, int]]:
        """(step, free GPU blocks after it) for every step that finished."""
        return [(s.step, s.snapshot.scheduler["num_free_gpu_blocks"]) for s in self.steps
                if s.snapshot is not None]


# -- recording ------------------------------------------------------------------------------------
def record(engine, workload: list[Request], max_steps: int = 200,
           keep_logits: bool = True) -> Recording:
    """Step ``engine`` through ``workload`` and keep every step as plain data.

    A step that raises ends the recording (``Recording.error``); so does reaching ``max_steps``
    with requests unfinished.

    Args:
        engine: an ``LLMEngine`` (or any object with its interface), with no requests yet.
        workload: the requests, each with the step it arrives at and maybe one it is aborted at.
        max_steps: the most steps to run.
        keep_logits: keep each step's logits (``(rows, vocab)`` float32 a step; off: compare
            everything else).
    """
    if not isinstance(workload, (list, tuple)) or not all(isinstance(r, Request)
                                                          for r in workload):
        raise ValueError("workload must be a list of engine_diff.Request")
    run = Recording(list(workload))
    snapshots: list = []
    calls: list = []
    groups: dict[str, object] = {}  # request id -> its SequenceGroup
    engine.add_observer(snapshots.append)
    restore = _spy_on_model(engine, calls, keep_logits)
    try:
        for number in range(1, max_steps + 1):
            for i, request in enumerate(workload):
                if request.arrive_at_step == number - 1:
                    rid = engine.add_request(str(i), None, request.params, arrival_time=float(i),
                                             prompt_token_ids=list(request.prompt_token_ids))
                    groups[rid] = _find_group(engine, rid)
                if request.abort_at_step == number - 1:
                    aborted = engine.abort_request(str(i))
                    if aborted is not None:
                        run.outputs[aborted.request_id] = aborted
            if not engine.has_unfinished_requests() and all(r.arrive_at_step < number
                                                            for r in workload):
                return run
            del snapshots[:], calls[:]
            try:
                returned = engine.step()
            except Exception as crash:  # the crash is what this step did
                run.error = f"{type(crash).__name__}: {crash} ({_where(crash)})"
                run.steps.append(StepRecord(number, {"error": {"crash": run.error}},
                                            error=run.error))
                return run
            for out in returned:
                run.outputs[out.request_id] = out
            snap = snapshots[-1] if snapshots else None
            run.steps.append(StepRecord(number, _state(engine, groups, snap, calls, returned),
                                        [(rows, logits) for rows, _, logits in calls
                                         if logits is not None], snap))
        run.error = f"requests still unfinished after {max_steps} steps"
        return run
    finally:
        restore()
        engine.remove_observer(snapshots.append)


def _where(crash: Exception) -> str:
    """Where ``crash`` was raised: the innermost frame's file (from the package root on), line
    and function."""
    frame = traceback.extract_tb(crash.__traceback__)[-1]
    path = frame.filename.replace("\\", "/")
    path = path[path.rfind("minipaged/"):] if "minipaged/" in path else path
    return f"raised in {path}, line {frame.lineno}, in {frame.name}"


def _find_group(engine, request_id: str):
    for queue in (engine.scheduler.waiting, engine.scheduler.running, engine.scheduler.swapped):
        for group in queue:
            if group.request_id == request_id:
                return group
    raise RuntimeError(f"request {request_id} was added but is in no queue of the scheduler")


def _spy_on_model(engine, calls: list, keep_logits: bool):
    """Wrap ``engine.worker.execute_model`` so every call's inputs and logits are kept; returns
    the function that undoes it."""
    worker = engine.worker
    own = "execute_model" in vars(worker)
    original = worker.execute_model

    def execute_model(inputs):
        logits = original(inputs)  # (rows, vocab)
        kept = logits.detach().float().cpu().clone() if keep_logits else None
        calls.append((_row_names(inputs), _inputs_state(inputs), kept))
        return logits

    worker.execute_model = execute_model

    def restore():
        if own:
            worker.execute_model = original
        else:
            del worker.execute_model
    return restore


def _seq_name(group, seq_id: int) -> str:
    for index, seq in enumerate(group.seqs):
        if seq.seq_id == seq_id:
            return f"request {group.request_id} sequence {index}"
    return f"request {group.request_id} sequence id {seq_id}"


def _row_names(inputs) -> list[str]:
    names = [", ".join(_seq_name(row.seq_group, s) for s in row.seq_ids) for row in inputs.rows]
    for spec in getattr(inputs, "spec_rows", []):  # speculative decoding: k + 1 rows each
        names += [f"{_seq_name(spec.seq_group, spec.seq_id)} (verification row {j})"
                  for j in range(len(spec.draft_token_ids) + 1)]
    return names


def _inputs_state(inputs) -> dict[str, object]:
    meta = inputs.meta
    listed = lambda t: t.tolist() if t is not None else None  # noqa: E731
    return {"input_ids": listed(inputs.input_ids), "positions": listed(inputs.positions),
            "slot_mapping": listed(meta.slot_mapping), "prompt_lens": list(meta.prompt_lens),
            "block_tables": listed(meta.block_tables), "context_lens": listed(meta.context_lens),
            "chunk_block_tables": listed(meta.chunk_block_tables),
            "chunk_context_lens": listed(meta.chunk_context_lens)}


def _state(engine, groups: dict, snap, calls: list, returned) -> dict[str, dict[str, object]]:
    """The plain data of one step, by group of ``FIELD_GROUPS``."""
    name_of = {seq.seq_id: _seq_name(g, seq.seq_id) for g in groups.values() for seq in g.seqs}
    state: dict[str, dict[str, object]] = {"error": {"crash": None}}
    if snap is not None:
        state["schedule"] = {
            "scheduled": [[rid, prompt] for rid, prompt in zip(snap.scheduled, snap.prompt_run)],
            "preempted": [list(p) for p in snap.preempted],
            "num_batched_tokens": snap.num_batched_tokens,
            "blocks_to_swap_out": dict(snap.blocks_to_swap_out),
            "blocks_to_swap_in": dict(snap.blocks_to_swap_in),
            "blocks_to_copy": {k: list(v) for k, v in snap.blocks_to_copy.items()}}
    state["inputs"] = {f"{'' if len(calls) == 1 else f'model call {i + 1}: '}{name}": value
                       for i, (_, fields, _) in enumerate(calls) for name, value in fields.items()}
    state["sequences"] = {
        name_of[seq.seq_id]: {"token_ids": list(seq.get_token_ids()), "status": seq.status.name,
                              "num_computed_tokens": seq.num_computed_tokens}
        for g in groups.values() for seq in g.seqs}
    blocks = engine.scheduler.block_snapshot()
    state["blocks"] = {
        "block_tables": {name_of.get(s["seq_id"], f"sequence id {s['seq_id']}"):
                         [s["device"], s["block_table"]] for s in blocks["sequences"]},
        "gpu_ref_counts": {b["block_number"]: b["ref_count"] for b in blocks["gpu_blocks"]
                           if b["ref_count"]},
        "cpu_ref_counts": {b["block_number"]: b["ref_count"] for b in blocks["cpu_blocks"]
                           if b["ref_count"]},
        "free_gpu_blocks": list(blocks["free_gpu_blocks"]),
        "free_cpu_blocks": list(blocks["free_cpu_blocks"])}
    scheduler = engine.scheduler
    state["queues"] = {name: [g.request_id for g in getattr(scheduler, name)]
                       for name in ("waiting", "running", "swapped")}
    state["outputs"] = {out.request_id: [out.finished, [[list(c.token_ids), c.finish_reason]
                                                        for c in out.outputs]]
                        for out in returned}
    return state


# -- comparing ------------------------------------------------------------------------------------
@dataclass
class Difference:
    """The first thing that differs: at ``step``, ``field`` (``group.name[.key]``)."""

    step: int
    field: str
    reference: object
    suspect: object
    note: str = ""  # where in a list, or how far apart two logits rows are
    # GPU blocks held differently after that step: number -> (the reference's, the suspect's)
    blocks: dict = field(default_factory=dict)

    def __str__(self) -> str:
        text = (f"step {self.step}: {self.field} differs{f' ({self.note})' if self.note else ''}"
                f"\n  reference: {_short(self.reference)}\n  suspect:   {_short(self.suspect)}")
        for number, (ours, theirs) in list(self.blocks.items())[:SHOWN_BLOCKS]:
            text += f"\n  GPU block {number}: reference {ours}; suspect {theirs}"
        if len(self.blocks) > SHOWN_BLOCKS:
            text += f"\n  ... and {len(self.blocks) - SHOWN_BLOCKS} more blocks held differently"
        return text


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...]"


def compare(reference: Recording, suspect: Recording, atol: float = 1e-3,
            rtol: float = 1e-3) -> Difference | None:
    """The first difference between two recordings of the same workload, or None.

    Steps are compared in order, and a step's fields in the order of ``FIELD_GROUPS``; within a
    list the first index that differs is named. Logits agree when every entry is within
    ``atol + rtol * |reference|``.

    Args:
        reference, suspect: ``record``'s results on the same workload.
        atol, rtol: the logits' tolerance.
    """
    if reference.workload != suspect.workload:
        raise ValueError("the recordings ran different workloads: record both on the same list")
    for ref_step, sus_step in zip(reference.steps, suspect.steps):
        found = _compare_step(ref_step, sus_step, atol, rtol)
        if found is not None:
            if not (ref_step.error or sus_step.error):  # (a crashed step kept no blocks)
                found.blocks = blocks_that_differ(ref_step.fields.get("blocks", {}),
                                                  sus_step.fields.get("blocks", {}))
            return found
    n_ref, n_sus = len(reference.steps), len(suspect.steps)
    if n_ref != n_sus:
        longer = reference if n_ref > n_sus else suspect
        step = min(n_ref, n_sus) + 1
        extra = f"a step {step}" if longer.steps[step - 1].error is None else \
            f"a step {step} that crashed: {longer.steps[step - 1].error}"
        ends = {id(r): (f"stopped after step {len(r.steps)}: {r.error}" if r.error else
                        f"all done after step {len(r.steps)}") for r in (reference, suspect)}
        return Difference(step, "steps", extra if longer is reference else ends[id(reference)],
                          extra if longer is suspect else ends[id(suspect)])
    return None


def _compare_step(ref: StepRecord, sus: StepRecord, atol: float, rtol: float):
    if ref.error != sus.error:
        return Difference(ref.step, "error.crash", ref.error or "no error",
                          sus.error or "no error")
    for group in FIELD_GROUPS[1:]:
        if group == "logits":
            found = _compare_logits(ref, sus, atol, rtol)
            if found is not None:
                return found
            continue
        a, b = ref.fields.get(group, {}), sus.fields.get(group, {})
        for name in list(a) + [n for n in b if n not in a]:
            found = _first_mismatch(a.get(name), b.get(name))
            if found is not None:
                where, x, y = found
                return Difference(ref.step, f"{group}.{name}{where}", x, y,
                                  _token_note(group, name, where, a))
    return None


def _first_mismatch(a, b, where: str = ""):
    """(path, a's part, b's part) of the first place two plain values differ, or None."""
    if a == b:
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            path = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
            if key not in a or key not in b:
                return path, a.get(key, "(none)"), b.get(key, "(none)")
            found = _first_mismatch(a[key], b[key], path)
            if found is not None:
                return found
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_mismatch(x, y, f"{where}[{i}]") or (f"{where}[{i}]", x, y)
    return where, a, b


PER_TOKEN = ("input_ids", "positions", "slot_mapping")  # the inputs with one entry a token


def _token_note(group: str, name: str, where: str, fields: dict) -> str:
    """For a per-token input list: which token of the batch, at which position."""
    if (group != "inputs" or name not in PER_TOKEN or not where.startswith("[")
            or "positions" not in fields):
        return ""  # (context_lens, block_tables, prompt_lens ...: one entry a sequence)
    index = int(where[1:where.index("]")])
    positions, ids = fields["positions"], fields["input_ids"]
    if index < len(positions):
        return f"token {index} of the batch: token id {ids[index]} at position {positions[index]}"
    return ""


def _compare_logits(ref: StepRecord, sus: StepRecord, atol: float, rtol: float):
    for call, ((rows, a), (_, b)) in enumerate(zip(ref.logits, sus.logits), start=1):
        prefix = "" if len(ref.logits) == 1 else f"model call {call}: "
        if a.shape != b.shape:
            return Difference(ref.step, f"logits.{prefix}shape", list(a.shape), list(b.shape))
        gap = (a - b).abs()  # (rows, vocab)
        bad = gap > atol + rtol * a.abs()
        if bool(bad.any()):
            row = int(bad.any(dim=1).nonzero()[0])
            return Difference(
                ref.step, f"logits.{prefix}row {row} ({rows[row]})", _top(a[row]),
                _top(b[row]), f"largest |difference| {float(gap[row].max()):.3g}")
    return None


def _top(row: torch.Tensor, k: int = 3) -> str:
    values, ids = torch.topk(row, k)
    return ", ".join(f"token {int(i)}: {float(v):.3f}" for v, i in zip(values, ids))


def diff_engines(reference, suspect, workload: list[Request], max_steps: int = 200,
                 **tolerance) -> tuple[Difference | None, Recording, Recording]:
    """Record both engines on ``workload`` and compare: (first difference or None, the
    reference's recording, the suspect's).

    Args:
        reference, suspect: engines with no requests yet.
        workload: the requests.
        max_steps: the most steps each may run.
        tolerance: ``atol`` / ``rtol`` for the logits (see ``compare``).
    """
    run_a = record(reference, workload, max_steps)
    run_b = record(suspect, workload, max_steps)
    return compare(run_a, run_b, **tolerance), run_a, run_b
