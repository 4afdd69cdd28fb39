"""Lesson 03 exercises: ref counts on fork, and the copy-on-write decision on append.

    fork(parent_table, ref_counts) -> child_table
        the child's block table; ``ref_counts`` (block number -> count) is updated in place
    append_action(block_table, ref_counts, needs_new_block) -> str
        what ``append_slot`` must do for the newest token of a sequence: "new block" (it opens a
        logical block that has no physical block yet: ``needs_new_block``, lesson 02's rule,
        is given), "copy" (it goes into the last block, which another sequence also holds:
        copy-on-write) or "in place" (the last block is this sequence's alone)

Expected answers: a real ``BlockSpaceManager`` driven through random forks and appends.

The build track's component (``workbench``): ``BlockSpaceManager``, whose ``can_allocate``,
``allocate``, ``append_slot`` (copy-on-write), ``fork`` and ``free``, and the three methods the
package reads its tables through (``get_blocks``, ``set_blocks``, ``held_sequences``), the learner
writes from the stub ``MyBlockSpaceManager``, in a data structure of their own; its checker runs
the real scheduler on random traffic with parallel sampling, forks, preemption and finishes, next
to the package's manager, and compares them through those methods only.
"""
from __future__ import annotations

from minipaged.block import Device
from minipaged.sampling_params import SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, not_done, passed,
                                          rng_for)
from minipaged.exercises.block_manager_hints import (_EVENT_METHOD, _STATE_METHOD,  # noqa: F401
                                                     _manager_hint)
from minipaged.exercises.lockstep import (_arrivals, _broken_invariant, _Call,  # noqa: F401
                                          _first_wrong_call, _Lockstep, _manager_state,
                                          _to_finish)
from minipaged.exercises.workbench import Component, register
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


def _ref_counts(bm) -> dict[int, int]:
    return {b["block_number"]: b["ref_count"] for b in bm.snapshot()["gpu_blocks"]}


class _Family:
    """A request with ``n`` samples that grow and fork at random, on a real block manager."""

    def __init__(self, rng, block_size: int, n: int) -> None:
        self.rng, self.block_size = rng, block_size
        self.bm = BlockSpaceManager(block_size, num_gpu_blocks=256, num_cpu_blocks=0,
                                    watermark=0.0)
        prompt = list(range(rng.randint(1, 3 * block_size)))
        self.seqs = [Sequence(i, None, prompt, block_size) for i in range(n)]
        self.group = SequenceGroup("0", self.seqs, SamplingParams(n=n), arrival_time=0.0)
        self.bm.allocate(self.group)
        for seq in self.seqs:
            seq.status = SequenceStatus.RUNNING
        self.events: list[dict] = []
        self.bm.add_listener(self.events.append)

    def new_child(self, parent: Sequence) -> Sequence:
        child = Sequence(len(self.seqs), None, parent.prompt_token_ids, self.block_size)
        child.copy_state_from(parent)
        child.status = SequenceStatus.RUNNING
        self.seqs.append(child)
        self.group.seqs.append(child)
        return child

    def append(self, seq: Sequence) -> str:
        """Append a token through the real block manager; what did it do?"""
        seq.append_token_id(5, {5: 0.0})
        self.events.clear()
        self.bm.append_slot(seq)
        event = self.events[-1]
        if event["op"] == "copy_on_write":
            return "copy"
        return "new block" if event["new_block"] else "in place"


@exercise
def check_fork(fn, num_cases: int = 80, seed: int | None = 0) -> CheckResult:
    learner = Learner("fork", fn)
    rng = rng_for(seed)
    checked = 0
    for case in range(num_cases):
        fam = _Family(rng, rng.choice([1, 2, 4, 8]), rng.randint(1, 3))
        for _ in range(rng.randint(1, 4)):
            for _ in range(rng.randint(0, 5)):
                fam.append(rng.choice(fam.seqs))
            parent = rng.choice(fam.seqs)
            table = fam.bm.get_block_table(parent)
            refs = _ref_counts(fam.bm)
            inputs = f"parent_table={table}, ref_counts={ {b: refs[b] for b in table} }"
            got_table = learner(list(table), refs)
            child = fam.new_child(parent)
            fam.bm.fork(parent, child)
            expected_refs = _ref_counts(fam.bm)
            expected = (fam.bm.get_block_table(child), {b: expected_refs[b] for b in table})
            got = (got_table, {b: refs.get(b) for b in table})
            checked += 1
            if got != expected:
                if got[0] == expected[0]:
                    hint = ("the table is right, but the ref counts say how many tables hold "
                            "each block: what changed for the blocks in the new table?")
                else:
                    hint = ("fork copies the block TABLE (the list of numbers), not the blocks: "
                            "no block is allocated")
                fail(learner.name, case, inputs, got, expected, hint)
    return passed(learner, checked)


@exercise
def check_append_action(fn, num_cases: int = 80, seed: int | None = 0) -> CheckResult:
    learner = Learner("append_action", fn)
    rng = rng_for(seed)
    checked = 0
    for case in range(num_cases):
        fam = _Family(rng, rng.choice([1, 2, 4, 8]), rng.randint(1, 4))
        for _ in range(rng.randint(4, 16)):
            seq = rng.choice(fam.seqs)
            if rng.random() < 0.2:
                child = fam.new_child(seq)
                fam.bm.fork(seq, child)
                continue
            table = fam.bm.get_block_table(seq)
            refs = _ref_counts(fam.bm)
            needs_new_block = len(table) * fam.block_size <= seq.get_len()
            inputs = (f"block_table={table}, ref_counts={ {b: refs[b] for b in table} }, "
                      f"needs_new_block={needs_new_block}")
            got = learner(list(table), dict(refs), needs_new_block)
            expected = fam.append(seq)
            checked += 1
            if got != expected:
                if expected == "copy":
                    hint = ("who else reads the last block? writing into a block another "
                            "sequence holds would change that sequence's cache")
                elif expected == "new block":
                    hint = ("the newest token does not go into the last block at all, so who "
                            "else holds that block does not matter")
                else:
                    hint = "the last block has room and nobody else holds it: write in place"
                fail(learner.name, case, inputs, got, expected, hint)
    return passed(learner, checked)


# -- the build track: the block manager ---------------------------------------------------------
class MyBlockSpaceManager(BlockSpaceManager):
    """Your block manager: which physical blocks each sequence holds, and the rules of sharing.
    How you keep that is yours to choose; the package (swapping, snapshots, ``reserve_slot``,
    the scheduler, the pictures, the invariant checks) reads it only through the three methods
    at the end. The prefix cache of lesson 11 stays the package's: with it on, yours simply
    takes no cached block.

    What you have: ``self.gpu_allocator`` and ``self.cpu_allocator`` (lesson 02: ``allocate``,
    ``free``, ``acquire``, ``get_num_free_blocks``), ``self.block_size``,
    ``self.watermark_blocks``, ``self.prompt_layout(seq_group)`` (how a waiting group's
    sequences share blocks) and ``self._allocator_of(block)`` (the pool a block belongs to).
    What the listeners hear (the lesson's pictures replay it): ``self._emit(op, **details)``
    tells them one event; each method's docstring says which.

    What must hold after every call: a block's ref count is the number of sequences whose
    table lists it, and a block on a free list is listed by nobody. The checker runs the package's scheduler on your manager and on the
    package's and compares what the methods return, what the listeners hear, the free lists,
    and each sequence's blocks as ``get_blocks`` gives them.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, enable_prefix_caching: bool = False) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                         enable_prefix_caching)
        # <- what you keep about the sequences that hold blocks (nothing holds any yet)

    def can_allocate(self, seq_group: SequenceGroup) -> bool:
        """Would admitting the group's waiting sequences leave at least
        ``self.watermark_blocks`` GPU blocks free?

        ``seqs, shared_len, identical = self.prompt_layout(seq_group)``: a fresh group's
        sequences hold the same tokens (``identical``) and share all of their blocks; after a
        preemption by recompute they differ, and share only their first ``shared_len`` tokens
        (whole blocks). A block the sequences share is one block.
        """
        not_done()  # <- your code here

    def allocate(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Each of the group's waiting sequences (``prompt_layout``'s ``seqs``) now holds a block
        for each of its logical blocks: the shared ones are the same blocks for all of them,
        the rest its own, taken from the GPU pool. Returns ``{seq_id: 0}`` for each (no token
        comes from a cache here).

        The listeners hear ``"allocate"`` with ``request_id``, ``seq_ids`` (the sequences'
        ids), ``blocks`` (the first sequence's block numbers) and ``cached=[]``.
        """
        not_done()  # <- your code here

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """The sequence's newest token gets a slot that no other sequence reads: in a new block
        when it opens a logical block the sequence holds no block for yet, else in its last
        block, which, if another sequence holds it too, the sequence first trades for a copy of
        its own (copy-on-write). Returns ``(src, dst)`` block numbers for such a copy, else
        None.

        The listeners hear ``"append"`` with ``seq_id``, ``block`` (the block number the token
        goes into) and ``new_block`` (True for a block just taken), or ``"copy_on_write"`` with
        ``seq_id``, ``src`` and ``dst``.
        """
        not_done()  # <- your code here

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child continues from the parent: it holds the parent's blocks, in the same order
        (no data is copied); from now on a change to one sequence's blocks is not a change to
        the other's.

        The listeners hear ``"fork"`` with ``parent``, ``child`` (their ids) and ``blocks`` (the
        child's block numbers).
        """
        not_done()  # <- your code here

    def free(self, seq: Sequence) -> None:
        """The sequence holds no block afterwards; each block it held has one holder fewer, and
        the ones nobody holds go back to their pool (GPU or CPU) last block first, so that its
        first block is the next one out. Nothing happens for a sequence that holds none.

        The listeners hear ``"free"`` with ``seq_id`` and ``blocks`` (the block numbers it held,
        in its order); nothing for a sequence that held none.
        """
        not_done()  # <- your code here

    # -- how the rest of the package reads your tables ------------------------------------------
    def get_blocks(self, seq_id: int) -> list:
        """The physical blocks sequence ``seq_id`` holds, in logical order, as a new list: the
        caller may change it, and that changes nothing here. ``[]`` for a sequence that holds
        none (never admitted, or freed). The scheduler calls it for every running sequence at
        every step.
        """
        not_done()  # <- your code here

    def set_blocks(self, seq_id: int, blocks: list) -> None:
        """Sequence ``seq_id``, which holds blocks, holds ``blocks`` (in this order) from now on,
        in place of what it held; the caller has already set their ref counts (swapping moves a
        sequence to the other pool this way, and speculative decoding grows and cuts tables).
        """
        not_done()  # <- your code here

    def held_sequences(self) -> list:
        """``(sequence, request_id)`` for every sequence that holds blocks, in any order: the
        ``Sequence`` objects themselves, as ``allocate`` and ``fork`` were given them.
        """
        not_done()  # <- your code here


def _check_block_space_manager(candidate, rng, num_cases: int) -> int:
    """Random traffic through the real scheduler (parallel sampling, forks, preemption by
    recompute and by swap, finishes) on the learner's manager and the package's, in lockstep;
    the managers are compared after every call."""
    name = "BlockSpaceManager"
    for case in range(num_cases):
        block_size = rng.choice([1, 2, 4])
        num_gpu, num_cpu = rng.randint(6, 16), rng.choice([0, 8, 32])
        mode = "recompute" if num_cpu == 0 else rng.choice([None, "swap", "recompute"])
        watermark = rng.choice([0.0, 0.0, 0.15])
        config = SchedulerConfig(preemption_mode=mode,
                                 max_num_batched_tokens=rng.choice([4096, 6]))
        pool = (f"{num_gpu} GPU / {num_cpu} CPU blocks of {block_size} tokens, watermark "
                f"{watermark}, preemption {mode or 'by group size'}")
        theirs, mine = (_Lockstep(block_size, num_gpu, num_cpu, watermark, config, cls,
                                  record_calls=True)
                        for cls in (BlockSpaceManager, candidate))

        def compare(step: int, call: str, outs=None) -> None:
            inputs = f"{pool}; step {step}: {call}"
            wrong = _first_wrong_call(theirs, mine)
            if wrong is not None:
                inputs += f"; first wrong call: {wrong[0].call}"
                if wrong[1] == "broken":  # shown as it was right after that call
                    fail(name, case, inputs, wrong[0].broken,
                         "ref counts = tables holding each block, a list of its own each",
                         _manager_hint(wrong, "allocate"))
            if theirs.events != mine.events:
                at = next((i for i, (a, b) in enumerate(zip(theirs.events, mine.events))
                           if a != b), min(len(theirs.events), len(mine.events)))
                want = theirs.events[at] if at < len(theirs.events) else None
                got = mine.events[at] if at < len(mine.events) else None
                op = (want or got)["op"]
                method = _EVENT_METHOD.get(op, "allocate")
                if want and got is None and op == "allocate" or want is None and op == "allocate":
                    method = "can_allocate"  # one admitted the group, the other did not
                fail(name, case, f"{inputs}; the listeners heard", got, want,
                     _manager_hint(wrong, method))
            method = next((_EVENT_METHOD[e["op"]] for e in theirs.events
                           if e["op"] in _EVENT_METHOD), "allocate")
            broken = _broken_invariant(mine.bm)
            if broken:
                fail(name, case, inputs, broken, "ref counts = tables holding each block",
                     _manager_hint(wrong, method))
            got, want = _manager_state(mine.bm), _manager_state(theirs.bm)
            if outs is not None:
                got["blocks_to_copy"], want["blocks_to_copy"] = outs
            if got != want:
                differs = [k for k in want if got[k] != want[k]]
                if set(differs) <= set(_STATE_METHOD):
                    method = _STATE_METHOD[differs[0]]
                fail(name, case, inputs, {k: got[k] for k in differs},
                     {k: want[k] for k in differs}, _manager_hint(wrong, method))
            for lock in (theirs, mine):
                lock.events.clear()
                lock.calls.clear()

        for step in range(rng.randint(4, 24)):
            for prompt, n in _arrivals(rng, block_size):
                for lock in (theirs, mine):
                    lock.arrive(prompt, n)
            outs = [lock.run.scheduler.schedule() for lock in (theirs, mine)]
            ops = sorted({e["op"] for e in theirs.events}) or ["nothing"]
            compare(step, f"schedule() ({', '.join(ops)})",
                    (outs[1].blocks_to_copy, outs[0].blocks_to_copy))
            for lock, out in zip((theirs, mine), outs):
                lock.after_model(out)
            running = [s for g in theirs.run.scheduler.running if not g.pending_chunks
                       for s in g.get_seqs(SequenceStatus.RUNNING)]
            if running and rng.random() < 0.3:  # a beam continues from another (lesson 03)
                parent = rng.choice(running).seq_id
                children = [lock.run.fork(lock.run.seq(parent)) for lock in (theirs, mine)]
                compare(step, f"fork(seq {parent} -> seq {children[0].seq_id})")
            for seq_id in _to_finish(rng, theirs, block_size):
                for lock in (theirs, mine):
                    lock.run.finish(lock.run.seq(seq_id))
                compare(step, f"the sequence finished: free(seq {seq_id})")
    return num_cases


register(Component(
    name="BlockSpaceManager", lesson="03",
    # where the engine's scheduler (Scheduler.with_pools) and the model-free DryRun build it
    slots=("minipaged.core.scheduler:BlockSpaceManager", "minipaged.lab.dry_run:BlockSpaceManager"),
    check=_check_block_space_manager,
    solution="minipaged.exercises.answers.lesson03:MyBlockSpaceManager",
    preamble="from minipaged.exercises.lesson03 import *",
))
