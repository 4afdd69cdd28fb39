"""Two model-free engines side by side, for the build track's checkers of lessons 03, 04 and 09.

``_Lockstep`` is a ``DryRun`` (scheduler and block manager, no model) built from the package's
classes or the learner's; a checker drives two of them with the same random traffic and
compares them after every step. With ``record_calls`` each run also logs every call of the
block manager's methods the learner writes (what it returned, the events it sent, the state
after it), so that a checker can name the first call that went wrong, not only the step.
"""
from __future__ import annotations

from minipaged.block import Device
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler import Scheduler
from minipaged.lab.dry_run import DryRun
from minipaged.sequence import SequenceStatus

# the manager's methods the learner writes (lesson 03), as the scheduler calls them
_LEARNER_METHODS = ("can_allocate", "allocate", "append_slot", "fork", "free")


def _held(bm) -> dict[int, tuple]:
    """seq_id -> (sequence, request id, blocks), through the manager's interface only
    (``held_sequences``, ``get_blocks``): the learner keeps the tables in any structure."""
    return {seq.seq_id: (seq, request_id, bm.get_blocks(seq.seq_id))
            for seq, request_id in bm.held_sequences()}


def _manager_state(bm) -> dict:
    """What must be the same in the learner's manager and the package's after every call, as
    the rest of the package reads it; a sequence that holds nothing (never admitted, freed)
    has no blocks."""
    held = _held(bm)
    top = max(held, default=-1) + 3  # and a few ids that hold nothing: freed or never held
    return {"block tables": {i: [b.block_number for b in held[i][2]] for i in sorted(held)},
            "free GPU blocks": bm.gpu_allocator.free_block_numbers(),
            "free CPU blocks": bm.cpu_allocator.free_block_numbers(),
            "sequences held": sorted(held),
            "their requests": {i: held[i][1] for i in sorted(held)},
            "their lengths": {i: held[i][0].get_len() for i in sorted(held)},
            "held by no sequence": [i for i in range(top) if i not in held
                                    and bm.get_blocks(i)]}


def _broken_invariant(bm) -> str | None:
    """The package's invariants, read through the interface: a block's ref count is the number
    of tables holding it, a free block is held by nobody, and ``get_blocks`` gives a list of
    the caller's own (changing it changes no table)."""
    held = _held(bm)
    for seq_id, (_, _, table) in sorted(held.items()):
        if type(table) is not list:
            return f"get_blocks({seq_id}) gave a {type(table).__name__}, not a list"
        table.append(None)  # a caller's change to the list it got...
        again = bm.get_blocks(seq_id)
        kept = bool(again) and again[-1] is None
        table.pop()
        if kept:  # ...shows in the table: undone, and named
            return (f"get_blocks({seq_id}) gave the list it keeps: a caller's change to it "
                    f"changed seq {seq_id}'s table")
    holders: dict[tuple, list[int]] = {}
    for seq_id, (_, _, table) in held.items():
        for block in table:
            key = (block.device is Device.GPU, block.block_number)  # (no enum hashing: fast)
            holders.setdefault(key, []).append(seq_id)
    for allocator in (bm.gpu_allocator, bm.cpu_allocator):
        free = None
        for block in allocator.blocks:
            who = holders.get((block.device is Device.GPU, block.block_number), [])
            if block.ref_count == len(who) and not who:
                continue
            if free is None:
                free = set(allocator.free_block_numbers())
            if block.ref_count != len(who):
                return (f"{block.device.value} block {block.block_number} has ref count "
                        f"{block.ref_count}, but {len(who)} block tables hold it")
            if who and block.block_number in free:
                return (f"{block.device.value} block {block.block_number} is on the free "
                        f"list while {len(who)} block tables hold it")
    return None


def _call_args(method: str, args) -> str:
    """A call of one of the manager's methods, in words (the ids of what it was given)."""
    def name(obj):
        if hasattr(obj, "request_id"):
            return f"request {obj.request_id}"
        return f"seq {obj.seq_id}" if hasattr(obj, "seq_id") else repr(obj)
    return f"{method}({', '.join(name(a) for a in args)})"


class _Call:
    """One call of the manager's own methods: what it returned, the events it sent, and the
    manager afterwards (state, and the ref-count invariant if it broke)."""

    def __init__(self, method: str, args, result, events: list[dict], bm,
                 check_invariant: bool = True) -> None:
        self.method, self.call = method, _call_args(method, args)
        self.seq_id = getattr(args[0], "seq_id", None) if args else None
        self.result = (bool(result) if method == "can_allocate" else  # as the scheduler reads
                       tuple(result) if method == "append_slot" and result is not None else
                       dict(result) if method == "allocate" and result is not None else result)
        self.events, self.state = events, _manager_state(bm)
        self.broken = _broken_invariant(bm) if check_invariant else None

    def differs_from(self, expected: "_Call") -> str | None:
        """What differs first: the call itself, its events, the invariant, its result, the
        state; None when nothing does."""
        if self.call != expected.call:
            return "call"
        for what in ("events", "broken", "result", "state"):
            if getattr(self, what) != getattr(expected, what):
                return what
        return None


def _record_calls(bm, calls: list[_Call], events: list[dict], check_invariant: bool) -> None:
    """Log every outermost call of the manager's own methods into ``calls`` (the invariant is
    checked after each only where asked: the package's manager keeps it)."""
    depth = [0]

    def recorded(method: str, fn):
        def call(*args, **kwargs):
            depth[0] += 1
            first_event = len(events)
            try:
                result = fn(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                calls.append(_Call(method, args, result, events[first_event:], bm,
                                   check_invariant))
            return result
        return call

    for method in _LEARNER_METHODS:
        setattr(bm, method, recorded(method, getattr(bm, method)))


class _Lockstep:
    """A model-free engine (``DryRun``) whose scheduler is ``scheduler_class`` holding a
    ``manager_class`` manager (one of the pair a checker runs side by side; lessons 03, 04, 09).
    With ``record_calls`` every call of the manager's own methods is logged in ``calls``."""

    def __init__(self, block_size, num_gpu, num_cpu, watermark, config,
                 manager_class=BlockSpaceManager, scheduler_class=Scheduler,
                 record_calls: bool = False):
        self.run = DryRun(block_size, num_gpu, num_cpu, watermark=watermark)
        self.bm = manager_class(block_size, num_gpu, num_cpu, watermark)
        self.run.block_manager = self.bm
        self.run.scheduler = scheduler_class(config, self.bm)
        self.events: list[dict] = []
        self.bm.add_listener(self.events.append)
        self.calls: list[_Call] = []
        if record_calls:
            _record_calls(self.bm, self.calls, self.events,
                          check_invariant=manager_class is not BlockSpaceManager)

    def arrive(self, prompt: list[int], n: int) -> None:
        self.run.add_request(prompt, n=n)

    def after_model(self, outs) -> None:
        """The step's sampled tokens (a fixed function of the sequence: both runs agree)."""
        self.run.sampled(outs, lambda seq: 100 + (7 * seq.seq_id + seq.get_len()) % 50)


def _first_wrong_call(theirs: _Lockstep, mine: _Lockstep) -> tuple[_Call, str, _Call | None] | None:
    """The learner's first call whose record differs from the package's, what differs, and
    the package's call at that place."""
    for want, got in zip(theirs.calls, mine.calls):
        what = got.differs_from(want)
        if what is not None:
            return got, what, want
    if len(mine.calls) != len(theirs.calls):  # one made a call the other did not
        extra = (mine.calls[len(theirs.calls)] if len(mine.calls) > len(theirs.calls)
                 else theirs.calls[len(mine.calls)])
        return extra, "call", None
    return None


def _arrivals(rng, block_size: int) -> list[tuple[list[int], int]]:
    """A step's new requests: (prompt, n), n > 1 for parallel sampling."""
    return [([rng.randrange(1000) for _ in range(rng.randint(1, 3 * block_size))],
             rng.choice([1, 1, 2, 3])) for _ in range(rng.choice([0, 0, 1, 2]))]


def _to_finish(rng, lock: _Lockstep, block_size: int) -> list[int]:
    """Running sequences that stop now (at random, and any grown past 6 blocks)."""
    return [s.seq_id for g in lock.run.scheduler.running if not g.pending_chunks
            for s in g.get_seqs(SequenceStatus.RUNNING)
            if rng.random() < 0.12 or s.get_len() > 6 * block_size]


def _squeeze_limit(lock: _Lockstep, config) -> str:
    """Lower ``max_num_seqs`` so that the oldest swapped group no longer fits beside the running
    sequences (an operator tightening the limit while groups are swapped out): without it the
    limit never binds on resume, for the groups swapped out were running together before.
    Returns what was done, in words ("" when nothing is swapped out)."""
    sched = lock.run.scheduler
    if getattr(lock, "squeezed", False):
        return f"max_num_seqs lowered to {config.max_num_seqs} earlier; "
    if not sched.swapped or config.max_num_seqs < 256:
        return ""
    lock.squeezed = True
    oldest = min(sched.swapped, key=lambda g: g.arrival_time)
    running = sum(g.num_seqs(SequenceStatus.RUNNING) for g in sched.running)
    config.max_num_seqs = max(1, running + oldest.num_seqs(SequenceStatus.SWAPPED) - 1)
    return f"max_num_seqs lowered to {config.max_num_seqs}; "


def _broken_queue_rule(scheduler) -> str | None:
    """The first sequence whose status is not its group's queue's (waiting: WAITING, running:
    RUNNING, swapped: SWAPPED; finished ones aside), in words; None when every one agrees."""
    for queue in ("waiting", "running", "swapped"):
        status = getattr(SequenceStatus, queue.upper())
        for group in getattr(scheduler, queue):
            for seq in group.get_seqs():
                if not seq.is_finished() and seq.status is not status:
                    return (f"request {group.request_id} is in the {queue} queue, but its "
                            f"sequence {seq.seq_id} is {seq.status.name}")
    return None
