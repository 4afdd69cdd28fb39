"""Lesson 03 exercises: ref counts on fork, and the copy-on-write decision on append.

    fork(parent_table, ref_counts) -> child_table
        the child's block table; ``ref_counts`` (block number -> count) is updated in place
    append_action(block_table, ref_counts, needs_new_block) -> str
        what ``append_slot`` must do for the newest token of a sequence: "new block" (it opens a
        logical block that has no physical block yet: ``needs_new_block``, lesson 02's rule,
        is given), "copy" (it goes into the last block, which another sequence also holds:
        copy-on-write) or "in place" (the last block is this sequence's alone)

Expected answers: a real ``BlockSpaceManager`` driven through random forks and appends.
"""
from __future__ import annotations

from minipaged.sampling_params import SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
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
