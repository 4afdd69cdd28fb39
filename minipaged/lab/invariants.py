"""The invariants of an engine's blocks and queues, checked after every step or on demand
(lesson 19).

    check_engine(engine)                      # on demand: a list of Violations (empty: all hold)
    watch = InvariantObserver(engine)         # after every step:
    engine.add_observer(watch)                #   watch.violations, watch.first

A ``Violation`` names the invariant broken (one of ``INVARIANTS``), what breaks it (a block, a
sequence, a request) and how. The invariants hold after every step of a correct engine, whatever
the workload; the first step that breaks one is usually the step where the bug acted.

They read the block manager through its interface (``held_sequences``, ``get_blocks``,
``gpu_allocator``, ``cpu_allocator``: however it keeps its tables, lesson 03) and the
scheduler's queues (``waiting``, ``running``, ``swapped``); nothing is changed.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from minipaged.block import Device
from minipaged.sequence import SequenceStatus

# name -> what must hold, in the order they are checked
INVARIANTS = {
    "free list lists a block once": "no block number appears twice in a pool's free list",
    "no block both free and held": "a block in the free list has ref count 0 and is in no table",
    "ref count = tables holding it": "a block's ref count is the number of block tables "
                                     "holding it",
    "every block is free or held": "a block with ref count 0 is in the free list (else leaked)",
    "free + held = pool": "free blocks plus blocks with a ref count add up to the pool, GPU and "
                          "CPU",
    "only live sequences hold blocks": "a block table belongs to a running or swapped sequence "
                                       "(waiting and finished ones have freed theirs)",
    "blocks on the sequence's device": "a running sequence's blocks are GPU blocks, a swapped "
                                       "one's CPU blocks",
    "block table covers the tokens": "a table has a block for every computed token, and no "
                                     "more blocks than the sequence has logical blocks",
    "a shared block holds the same tokens": "sequences sharing a block hold it at the same place "
                                            "and agree on every computed token up to its end "
                                            "(its K/V depend on all of them)",
    "a block serves one KV cache group": "a hybrid model's block (lesson 20) is held by the "
                                         "tables of one KV cache group only",
    "live sequences hold blocks": "every running or swapped sequence has a block table",
    "a group is in one queue": "each request is in one of waiting, running, swapped, once",
    "queue matches status": "the unfinished sequences of a group in the running queue are "
                            "RUNNING, in the swapped queue SWAPPED, in the waiting queue WAITING",
    "preempted groups leave running": "a group preempted in a step is waiting (recompute) or "
                                      "swapped (swap) after it",
}


@dataclass(frozen=True)
class Violation:
    """One broken invariant: ``invariant`` (a key of ``INVARIANTS``), ``subject`` (what breaks
    it), ``detail`` (how), ``step`` (after which step, when an observer found it)."""

    invariant: str
    subject: str
    detail: str
    step: int | None = None

    def __str__(self) -> str:
        when = f"after step {self.step}: " if self.step is not None else ""
        return f"{when}{self.invariant!r} broken by {self.subject}: {self.detail}"


def _seq_label(held: dict, seq_id: int) -> str:
    request = held[seq_id][1] if seq_id in held else None
    return f"sequence {seq_id}" + (f" (request {request})" if request is not None else "")


def held_tables(bm) -> dict[int, tuple]:
    """seq_id -> (sequence, request id, its physical blocks) for every sequence holding blocks,
    read through the manager's interface."""
    return {seq.seq_id: (seq, request_id, bm.get_blocks(seq.seq_id))
            for seq, request_id in bm.held_sequences()}


def check_block_manager(bm) -> list[Violation]:
    """The invariants of the pools and block tables (the first ten of ``INVARIANTS``).

    A hybrid model's manager (``core/hybrid_block_manager.py``) has more KV cache groups in
    ``groups``, each with its own tables over the same pool: a block's ref count is then the
    tables of every group holding it, and one group only may hold it.

    Args:
        bm: a ``BlockSpaceManager`` (or one with its ``block_size``, ``held_sequences``,
            ``get_blocks``, ``gpu_allocator`` and ``cpu_allocator``).
    """
    found: list[Violation] = []
    managers = [bm] + list(getattr(bm, "groups", []))  # the KV cache groups: one, or more
    # block -> (seq id, index, group)
    holders: dict[tuple[Device, int], list[tuple[int, int, int]]] = {}
    held = [held_tables(manager) for manager in managers]
    for group, tables in enumerate(held):
        for seq_id, (_, _, table) in tables.items():
            for index, block in enumerate(table):
                if block.block_number < 0:
                    continue  # a sliding window's dropped marker (core/sliding_window.py)
                holders.setdefault((block.device, block.block_number), []).append(
                    (seq_id, index, group))
    for allocator in (bm.gpu_allocator, bm.cpu_allocator):
        found += _check_pool(held[0], allocator, holders)
    for manager, tables in zip(managers, held):
        for seq_id, (seq, _, table) in tables.items():
            found += _check_table(manager.block_size, _seq_label(tables, seq_id), seq, table)
    for (device, number), who in holders.items():
        name = f"{device.value.upper()} block {number}"
        groups = sorted({group for _, _, group in who})
        if len(groups) > 1:
            found.append(Violation("a block serves one KV cache group", name,
                                   f"held by the tables of groups {groups}"))
        elif len(who) > 1:
            found += _check_shared(managers[groups[0]].block_size, held[groups[0]], name,
                                   [(s, i) for s, i, _ in who])
    return found


def _check_pool(tables_of: dict, allocator, holders) -> list[Violation]:
    found = []
    pool = allocator.device.value.upper()
    free = allocator.free_block_numbers()
    for number, times in Counter(free).items():
        if times > 1:
            found.append(Violation("free list lists a block once", f"{pool} block {number}",
                                   f"listed {times} times in the free list"))
    free_set = set(free)
    held = 0
    for block in allocator.blocks:
        who = holders.get((allocator.device, block.block_number), [])
        name, count = f"{pool} block {block.block_number}", block.ref_count
        tables = ", ".join(_seq_label(tables_of, s) for s, *_ in who) or "no table"
        if block.block_number in free_set and (count > 0 or who):
            found.append(Violation("no block both free and held", name,
                                   f"in the free list, with ref count {count}, held by {tables}"))
        if count != len(who):
            found.append(Violation("ref count = tables holding it", name,
                                   f"ref count {count}, held by {len(who)} table"
                                   f"{'' if len(who) == 1 else 's'} ({tables})"))
        if count == 0 and not who and block.block_number not in free_set:
            found.append(Violation("every block is free or held", name,
                                   "ref count 0, in no table and not in the free list: leaked"))
        held += count > 0
    num_free = allocator.get_num_free_blocks()
    if num_free + held != allocator.num_blocks:
        found.append(Violation("free + held = pool", f"the {pool} pool",
                               f"{num_free} free + {held} held = {num_free + held}, but the pool "
                               f"has {allocator.num_blocks} blocks"))
    return found


def _check_table(block_size: int, label: str, seq, table) -> list[Violation]:
    found = []
    if seq.status not in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
        found.append(Violation("only live sequences hold blocks", label,
                               f"it is {seq.status.name} and still holds blocks "
                               f"{[b.block_number for b in table]}"))
    device = {SequenceStatus.RUNNING: Device.GPU, SequenceStatus.SWAPPED: Device.CPU}.get(
        seq.status)
    wrong = [f"{b.device.value}#{b.block_number}" for b in table
             if device is not None and b.device is not device]
    if wrong:
        found.append(Violation("blocks on the sequence's device", label,
                               f"it is {seq.status.name}, yet holds {', '.join(wrong)}"))
    needed = math.ceil(seq.num_computed_tokens / block_size)
    if len(table) < needed or len(table) > len(seq.logical_token_blocks):
        found.append(Violation("block table covers the tokens", label,
                               f"{len(table)} blocks for {seq.num_computed_tokens} computed of "
                               f"{seq.get_len()} tokens (needs {needed} to "
                               f"{len(seq.logical_token_blocks)})"))
    return found


def _check_shared(block_size: int, held: dict, name: str,
                  who: list[tuple[int, int]]) -> list[Violation]:
    places = sorted({index for _, index in who})
    labels = " and ".join(_seq_label(held, s) for s, _ in who)
    if len(places) > 1:
        return [Violation("a shared block holds the same tokens", name,
                          f"held by {labels} as logical blocks {places}")]
    end = (places[0] + 1) * block_size
    seqs = [held[s][0] for s, _ in who if s in held]
    limit = min([end] + [s.num_computed_tokens for s in seqs])
    tokens = [s.get_token_ids()[:limit] for s in seqs]
    for position in range(limit):
        column = {t[position] for t in tokens}
        if len(column) > 1:
            return [Violation("a shared block holds the same tokens", name,
                              f"held by {labels} as logical block {places[0]}, whose computed "
                              f"tokens differ at position {position} "
                              f"({[t[position] for t in tokens]})")]
    return []


def check_scheduler(scheduler) -> list[Violation]:
    """``check_block_manager`` on the scheduler's block manager, and the queues' invariants.

    Args:
        scheduler: a ``Scheduler`` (or one with ``block_manager``, ``waiting``, ``running`` and
            ``swapped``).
    """
    bm = scheduler.block_manager
    found = check_block_manager(bm)
    holding = {seq.seq_id for seq, _ in bm.held_sequences()}
    expected = {"waiting": SequenceStatus.WAITING, "running": SequenceStatus.RUNNING,
                "swapped": SequenceStatus.SWAPPED}
    seen: dict[str, str] = {}
    for queue, status in expected.items():
        for group in getattr(scheduler, queue):
            rid = group.request_id
            if rid in seen:
                found.append(Violation("a group is in one queue", f"request {rid}",
                                       f"in {seen[rid]} and in {queue}"))
            seen[rid] = queue
            for seq in group.get_seqs():
                label = f"sequence {seq.seq_id} (request {rid})"
                if seq.is_finished():
                    continue
                if seq.status is not status:
                    found.append(Violation("queue matches status", label,
                                           f"{seq.status.name} in the {queue} queue"))
                elif queue != "waiting" and seq.seq_id not in holding:
                    found.append(Violation("live sequences hold blocks", label,
                                           f"{seq.status.name}, but it has no block table"))
    return found


def check_engine(engine) -> list[Violation]:
    """Every invariant that can be read from ``engine`` now (``check_scheduler`` of its
    scheduler). An empty list: all hold.

    Args:
        engine: an ``LLMEngine`` (or any object with its ``scheduler``).
    """
    return check_scheduler(engine.scheduler)


class InvariantObserver:
    """An engine observer that checks the invariants after every step.

        watch = InvariantObserver(engine); engine.add_observer(watch)

    Args:
        engine: the engine it watches (its state is read after each step).
        stop: raise ``InvariantError`` at the first violation (the step then fails where it
            broke the invariant), instead of only recording it.
    """

    def __init__(self, engine, stop: bool = False) -> None:
        self.engine = engine
        self.stop = stop
        self.violations: list[Violation] = []
        self.steps_checked = 0

    @property
    def first(self) -> Violation | None:
        """The first violation found (None: every step so far kept every invariant)."""
        return self.violations[0] if self.violations else None

    def first_step(self) -> list[Violation]:
        """Every violation found after the first step that had any."""
        if not self.violations:
            return []
        return [v for v in self.violations if v.step == self.violations[0].step]

    def __call__(self, snapshot) -> None:
        self.steps_checked += 1
        step = snapshot.step
        found = check_engine(self.engine)
        queues = {name: {g.request_id for g in getattr(self.engine.scheduler, name)}
                  for name in ("waiting", "running", "swapped")}
        for request_id, mode in snapshot.preempted:
            if request_id in queues["running"]:
                found.append(Violation("preempted groups leave running", f"request {request_id}",
                                       f"preempted ({mode}) in this step, yet running after it"))
        found = [Violation(v.invariant, v.subject, v.detail, step) for v in found]
        self.violations += found
        if found and self.stop:
            raise InvariantError(str(found[0]))


class InvariantError(AssertionError):
    """An ``InvariantObserver(stop=True)`` found a violation."""
