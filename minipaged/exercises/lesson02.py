"""Lesson 02 exercises: where a token's K/V live, and how a block table grows.

    slot_of(block_table, position, block_size) -> int
        the cache slot of the token at ``position``: physical block * block_size + offset
    grow_block_table(block_table, num_tokens, block_size, allocate) -> None
        the sequence now holds ``num_tokens`` tokens (the newest was just appended); if the
        newest token has no block yet, call ``allocate()`` and append the block number it returns

Expected answers: the ``slot_mapping`` of the flat batch (``lab.batch_inputs``) on block tables that a
real ``BlockSpaceManager`` scrambled, and the tables of ``BlockSpaceManager.append_slot``.

The build track's component (``workbench``): ``FreeListAllocator``, the pool's free list with
reference counts, written from the stub ``MyFreeListAllocator``; its checker runs random
allocate / free / fork sequences next to the package's allocator.
"""
from __future__ import annotations

import torch

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.allocator import FreeListAllocator, NoCacheAllocator
from minipaged.sampling_params import SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.exercises.checking import (CheckResult, Learner, NotDone, exercise, fail, not_done,
                                          passed, rng_for)
from minipaged.exercises.workbench import Component, register
from minipaged.lab.batch_inputs import prepare_inputs_for_groups
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


def _admit(bm, seq_id, num_tokens, block_size):
    seq = Sequence(seq_id, None, list(range(100, 100 + num_tokens)), block_size)
    group = SequenceGroup(str(seq_id), [seq], SamplingParams(), arrival_time=float(seq_id))
    bm.allocate(group)
    seq.status = SequenceStatus.RUNNING
    return seq, group


@exercise
def check_slot_of(fn, num_cases: int = 60, seed: int | None = 0) -> CheckResult:
    learner = Learner("slot_of", fn)
    rng = rng_for(seed)
    checked = 0
    for case in range(num_cases):
        block_size = rng.choice([1, 2, 4, 8, 16])
        bm = BlockSpaceManager(block_size, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0.0)
        # Admit and free a few requests so the next table's blocks are scattered in the pool.
        seqs = [_admit(bm, i, rng.randint(1, 5 * block_size), block_size)[0] for i in range(4)]
        for seq in rng.sample(seqs, 2):
            bm.free(seq)
        seq, group = _admit(bm, 9, rng.randint(1, 6 * block_size), block_size)
        batch = prepare_inputs_for_groups([group], bm, block_size, torch.device("cpu"))
        table = bm.get_block_table(seq)
        for position, expected in enumerate(batch.meta.slot_mapping.tolist()):
            got = learner(list(table), position, block_size)
            checked += 1
            if got != expected:
                if got == table[position // block_size] + position % block_size:
                    hint = "a block number counts blocks, not slots: how many slots lie before it?"
                elif got == position:
                    hint = "the slot comes from the block TABLE, not from the position alone"
                else:
                    hint = ("which logical block holds the position, and where in that block? "
                            "the table says which physical block that logical block is")
                fail(learner.name, case, f"block_table={table}, position={position}, "
                     f"block_size={block_size}", got, expected, hint)
    return passed(learner, checked)


@exercise
def check_grow_block_table(fn, num_cases: int = 60, seed: int | None = 0) -> CheckResult:
    learner = Learner("grow_block_table", fn)
    rng = rng_for(seed)
    checked = 0
    for case in range(num_cases):
        block_size = rng.choice([1, 2, 3, 4, 8, 16])
        bm = BlockSpaceManager(block_size, num_gpu_blocks=128, num_cpu_blocks=0, watermark=0.0)
        seq, _ = _admit(bm, 0, rng.randint(1, 3 * block_size), block_size)
        mine = bm.get_block_table(seq)
        for _ in range(rng.randint(1, 3 * block_size + 2)):
            before = list(mine)
            seq.append_token_id(7, {7: 0.0})
            calls = []
            next_free = bm.snapshot()["free_gpu_blocks"][0]

            def allocate():
                calls.append(next_free)
                return next_free

            learner(mine, seq.get_len(), block_size, allocate)
            bm.append_slot(seq)
            expected = bm.get_block_table(seq)
            checked += 1
            if mine != expected:
                new_block = len(expected) > len(before)
                hint = ("the table grows only when the newest token does not fit in the "
                        "blocks it already has") if new_block or calls else \
                    "append the block number that allocate() returns"
                if len(calls) > 1:
                    hint = "call allocate() at most once per new token"
                fail(learner.name, case, f"block_table={before}, num_tokens={seq.get_len()}, "
                     f"block_size={block_size}", mine, expected, hint)
    return passed(learner, checked)


# -- the build track: the free-list allocator --------------------------------------------------
class MyFreeListAllocator(NoCacheAllocator):
    """The blocks of one pool (GPU or CPU): which are free, and how many block tables hold each.
    How you keep the free ones is yours to choose; what is checked is what the methods below
    return, and how their cost grows with the pool (up to 100,000 blocks).

    ``NoCacheAllocator`` already answers the prefix cache's questions (lesson 11) with "nothing
    cached"; what is left is the pool itself.

    Args:
        device: the pool's device (``Device.GPU`` or ``Device.CPU``).
        block_size: tokens per block.
        num_blocks: blocks in the pool, numbered 0 .. num_blocks - 1.
    """

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        """Keep ``device``, ``block_size``, ``num_blocks``, ``num_evictions = 0`` and ``blocks``:
        every ``PhysicalTokenBlock(device, number, block_size)`` of the pool, by number. All
        are free; block 0 is handed out first, then 1, ..."""
        not_done()  # <- your code here

    def allocate(self) -> PhysicalTokenBlock:
        """A free block, now with ref count 1: the one freed most recently (last in, first out;
        in a new pool block 0, then 1, ...). ``ValueError`` when no block is free."""
        not_done()  # <- your code here

    def free(self, block: PhysicalTokenBlock) -> None:
        """One block table lets go of ``block``: one reference less; a block nobody holds is
        free again. ``ValueError`` for a block of the other pool or one that is free already."""
        not_done()  # <- your code here

    def acquire(self, block: PhysicalTokenBlock) -> None:
        """One more block table holds ``block`` (a fork, lesson 03): one reference more."""
        not_done()  # <- your code here

    def get_num_free_blocks(self) -> int:
        """How many blocks ``allocate`` can still hand out."""
        not_done()  # <- your code here

    def free_block_numbers(self) -> list[int]:
        """The numbers of the free blocks, the next one ``allocate`` hands out first."""
        not_done()  # <- your code here


def _pool_state(allocator) -> dict:
    return {"get_num_free_blocks()": allocator.get_num_free_blocks(),
            "free_block_numbers()": list(allocator.free_block_numbers()),
            "ref counts": [b.ref_count for b in allocator.blocks]}


_ALLOCATOR_HINTS = {
    "allocate": "last in, first out: the block freed last is the next one out (and at "
                "first, block 0 comes out first)",
    "allocate's ref count": "the right block, but its ref count is not 1: allocate hands the "
                            "block to ONE block table, so it is held once (ref_count = 1), "
                            "whatever it was before",
    "free": "free() drops ONE reference; only a block that no table holds any more is free "
            "again, and then it is the next one out",
    "acquire": "a fork means one more block table holds the block: what counts the tables?",
    "free a free block": "a block nobody holds cannot be freed again: say so with ValueError "
                         "(as the package does) and change nothing",
    "foreign": "a block of the other pool is not this pool's to free: ValueError, and change "
               "nothing",
    "allocate from a full pool": "with no block free there is nothing to hand out: "
                                 "ValueError, and change nothing",
    "blocks": "keep every block of the pool in self.blocks, indexed by its number: "
              "PhysicalTokenBlock(device, number, block_size), all free at first",
    # the state is right but for what one of the two reading methods says
    "get_num_free_blocks()": "the ref counts and the free blocks are right, but "
                             "get_num_free_blocks() is not: it is how many blocks allocate can "
                             "still hand out, every free block (a block freed again counts "
                             "too)",
    "free_block_numbers()": "the same free blocks, in another order: free_block_numbers() "
                            "lists them in the order allocate hands them out, the next one "
                            "out first",
}


def _allocator_hint(op: str, got: dict, expected: dict) -> str:
    """The hint for a state that differs after ``op``: that operation's rule, unless only a
    method that reads the state is wrong (then that method's)."""
    differs = [k for k in got if got[k] != expected[k]]
    if differs == ["get_num_free_blocks()"]:
        return _ALLOCATOR_HINTS["get_num_free_blocks()"]
    if differs == ["free_block_numbers()"] and sorted(got[differs[0]]) == sorted(
            expected[differs[0]]):
        return _ALLOCATOR_HINTS["free_block_numbers()"]
    return _ALLOCATOR_HINTS[op]


def _check_free_list_allocator(candidate, rng, num_cases: int) -> int:
    """Random allocate / free / acquire (fork) sequences, and calls that must fail, next to the
    package's ``FreeListAllocator``; the states are compared after every call."""
    name = "FreeListAllocator"
    for case in range(num_cases):
        device = rng.choice([Device.GPU, Device.CPU])
        other = Device.CPU if device is Device.GPU else Device.GPU
        num_blocks, block_size = rng.randint(1, 8), rng.choice([1, 4, 16])
        mine = candidate(device, block_size, num_blocks)
        theirs = FreeListAllocator(device, block_size, num_blocks)
        calls = [f"{type(mine).__name__}({device}, block_size={block_size}, "
                 f"num_blocks={num_blocks})"]
        blocks = getattr(mine, "blocks", None)
        if (not isinstance(blocks, list)
                or [(b.block_number, b.device) for b in blocks]
                != [(b.block_number, b.device) for b in theirs.blocks]):
            fail(name, case, calls[0], f"blocks = {blocks!r}", f"blocks = {theirs.blocks!r}",
                 _ALLOCATOR_HINTS["blocks"])
        for _ in range(rng.randint(1, 30)):
            held = [b.block_number for b in theirs.blocks if b.ref_count > 0]
            unheld = [b.block_number for b in theirs.blocks if b.ref_count == 0]
            # Odd cases also make the calls that must fail (even ones: ordinary calls only).
            op = rng.choice(["allocate"] * 4 + ["free"] * 3 * bool(held)
                            + ["acquire"] * bool(held) + ["refuse"] * (case % 2))
            if op == "refuse":
                kind = rng.choice(["free a free block"] * bool(unheld) + ["foreign"]
                                  + ["allocate from a full pool"] * (not unheld))
                if kind == "foreign":
                    number = rng.randrange(num_blocks)
                    calls.append(f"free(a block of the {other.value} pool, #{number}) "
                                 f"-> ValueError")
                    call = lambda a: a.free(PhysicalTokenBlock(other, number, block_size))
                elif kind == "allocate from a full pool":
                    calls.append("allocate() with no block free -> ValueError")
                    call = lambda a: a.allocate()
                else:
                    number = rng.choice(unheld)
                    calls.append(f"free(block {number}, which is free) -> ValueError")
                    call = lambda a: a.free(a.blocks[number])
                try:
                    call(mine)
                    got = "no error"
                except ValueError:
                    got = None
                except NotDone:
                    raise
                except Exception as error:  # the wrong kind of error
                    got = f"{type(error).__name__}: {error}"
                if got is not None:
                    fail(name, case, "; ".join(calls[-8:]), got, "ValueError",
                         _ALLOCATOR_HINTS[kind])
            elif op == "allocate":
                if not unheld:
                    continue
                expected = theirs.allocate()
                got = mine.allocate()
                calls.append(f"allocate() -> block {expected.block_number}")
                if (getattr(got, "block_number", None), getattr(got, "ref_count", None)) != (
                        expected.block_number, 1):
                    right_block = getattr(got, "block_number", None) == expected.block_number
                    fail(name, case, "; ".join(calls[-8:]), got, expected, _ALLOCATOR_HINTS[
                        "allocate's ref count" if right_block else "allocate"])
            else:
                number = rng.choice(held)
                calls.append(f"{op}(block {number})")
                getattr(theirs, op)(theirs.blocks[number])
                getattr(mine, op)(mine.blocks[number])
            got, expected = _pool_state(mine), _pool_state(theirs)
            if got != expected:
                differs = {k: got[k] for k in got if got[k] != expected[k]}
                fail(name, case, "; ".join(calls[-8:]), differs,
                     {k: expected[k] for k in differs},
                     _allocator_hint(kind if op == "refuse" else op, got, expected))
    return num_cases


register(Component(
    name="FreeListAllocator", lesson="02",
    # where the block manager builds its plain GPU pool and its CPU pool
    slots=("minipaged.core.block_manager:FreeListAllocator",),
    check=_check_free_list_allocator,
    solution="minipaged.exercises.answers.lesson02:MyFreeListAllocator",
    preamble="from minipaged.exercises.lesson02 import *",
))
