"""Lesson 11's build-track check: the learner's prefix-caching allocator and the package's,
driven side by side as the block manager drives them (prompts with shared prefixes, growing
sequences, swaps out and in, frees, evictions, resets), compared after every operation through
the allocator's interface only (``_allocator_state``): how the learner stores the cache is not
looked at. The hints are in ``prefix_cache_hints.py``.
"""
from __future__ import annotations

from minipaged.block import Device
from minipaged.core.allocator import FreeListAllocator
from minipaged.core.prefix_caching_allocator import PrefixCachingAllocator, block_hash
from minipaged.exercises.checking import fail
from minipaged.exercises.prefix_cache_hints import (NAMING_EVICTS, OPERATION_HINTS,
                                                    STATE_HINTS, kept_a_name)


def _colliding_hash(parent_hash, token_ids) -> int:
    """A hash with only 3 values: every lookup hits some block, so hits must be confirmed."""
    return hash((parent_hash, tuple(token_ids))) % 3


def _allocator_state(cache) -> dict[str, object]:
    """What the checker compares after every operation, through the allocator's interface."""
    return {"ref counts": [b.ref_count for b in cache.blocks],
            "names": [cache.block_hash_of(b) for b in cache.blocks],
            "cached blocks": [b.block_number for b in cache.blocks if cache.is_cached(b)],
            "evictable blocks (LRU first)": cache.evictable_block_numbers(),
            "free blocks (next first)": cache.free_block_numbers(),
            "free count": cache.get_num_free_blocks(),
            "evictions": cache.num_evictions}


class _Workload:
    """One case: the package's allocator and the candidate driven side by side, as the block
    manager drives them (prompts with shared prefixes, growing sequences, frees)."""

    def __init__(self, candidate, rng, case: int) -> None:
        self.rng, self.case = rng, case
        self.block_size = rng.choice([1, 2, 4])
        self.num_blocks = rng.randint(3, 10)
        self.colliding = case % 4 == 3
        hash_fn = _colliding_hash if self.colliding else block_hash
        self.expected = PrefixCachingAllocator(Device.GPU, self.block_size, self.num_blocks,
                                               hash_fn)
        self.yours = candidate(Device.GPU, self.block_size, self.num_blocks, hash_fn)
        size = self.block_size
        self.prefixes = [[rng.randrange(3) for _ in range(rng.randint(0, 3 * size))]
                         for _ in range(2)]
        self.seqs: dict[int, tuple[list[int], list, list]] = {}  # id -> tokens, two tables
        self.swapped: dict[int, tuple[list[int], list, list]] = {}  # the same, on the CPU
        self.cpu_yours, self.cpu_expected = (FreeListAllocator(Device.CPU, self.block_size, 64)
                                             for _ in range(2))
        self.log: list[str] = []

    def inputs(self, now: str) -> str:
        shown = self.log[-6:]
        return (f"block_size={self.block_size}, num_blocks={self.num_blocks}"
                f"{', a hash with 3 values (collisions)' if self.colliding else ''}; "
                f"{'... ' if len(self.log) > 6 else ''}"
                f"{'; '.join(shown) + '; ' if shown else ''}then {now}")

    def same(self, now: str, got, expected, hint: str) -> None:
        if got != expected:
            fail("PrefixCachingAllocator", self.case, self.inputs(now), got, expected, hint)

    def compare_states(self, now: str, operation: str) -> None:
        """The two allocators after ``operation`` (free, acquire, allocate, name_blocks): the
        hint names that operation's rule, whichever field shows the difference."""
        mine, theirs = _allocator_state(self.yours), _allocator_state(self.expected)
        for key, hint in STATE_HINTS.items():
            if operation == "reset":
                hint = OPERATION_HINTS["reset"]
            elif key in ("free count", "evictions"):
                pass  # checked last: all else agrees, so its own method is the cause
            elif operation in OPERATION_HINTS:
                hint = OPERATION_HINTS[operation]
            elif key in ("evictable blocks (LRU first)", "free blocks (next first)") or (
                    key == "names" and kept_a_name(mine[key], theirs[key])):
                hint = NAMING_EVICTS  # (name_blocks: an evictable holder of the name goes)
            self.same(f"{now}: {key}", mine[key], theirs[key], hint)

    def allocate(self, now: str) -> tuple[object, object]:
        evicting = (self.expected.get_num_free_blocks()
                    == len(self.expected.evictable_block_numbers()))
        mine, theirs = self.yours.allocate(), self.expected.allocate()
        hint = ("when no block is truly free, allocate evicts the least recently used "
                "evictable block (the one freed longest ago) and hands it out" if evicting else
                "allocate takes a truly free block first, the one freed last, and evicts only "
                "when no block is truly free")
        self.same(f"{now}: allocate()", mine.block_number, theirs.block_number, hint)
        self.compare_states(f"{now}: after allocate()", "allocate")
        return mine, theirs

    def name(self, seq_id: int, now: str) -> None:
        tokens, mine, theirs = self.seqs[seq_id]
        size = self.block_size
        full = len(tokens) // size
        chunks = [tokens[i * size:(i + 1) * size] for i in range(full)]
        self.yours.name_blocks(mine[:full], [list(c) for c in chunks])
        self.expected.name_blocks(theirs[:full], chunks)
        self.compare_states(now + f", name_blocks of its {full} full blocks", "name_blocks")

    def admit(self, seq_id: int) -> None:
        rng, size = self.rng, self.block_size
        tokens = rng.choice(self.prefixes) + [rng.randrange(3)
                                              for _ in range(rng.randint(1, 2 * size))]
        max_blocks = (len(tokens) - 1) // size
        now = f"admit s{seq_id} {tokens}"
        theirs_found = self.expected.longest_cached_prefix(tokens, max_blocks)
        mine_found = self.yours.longest_cached_prefix(list(tokens), max_blocks)
        got = [b.block_number for b in mine_found]
        want = [b.block_number for b in theirs_found]
        if got != want:
            hint = ("walk the full blocks from the first: look each one up by the name made from "
                    "the block found before it, and stop at the first miss")
            if len(got) > max_blocks:
                hint = (f"at most max_blocks ({max_blocks}) blocks: the block holding the "
                        f"prompt's last token is never taken from the cache (that token is "
                        f"computed, to have logits to sample from)")
            elif len(got) > len(want):
                hint = ("a hash hit is only a hint: take a block only if it holds these token "
                        "ids right after the KV of the block found before it")
            self.same(f"{now}: longest_cached_prefix(max_blocks={max_blocks}) gives blocks",
                      got, want, hint)
        num_new = -(-len(tokens) // size) - len(want)
        if self.expected.get_num_free_blocks() < num_new + sum(
                b.ref_count == 0 for b in theirs_found):
            return  # does not fit: the block manager would not admit it
        for mine, theirs in zip(mine_found, theirs_found):
            self.yours.acquire(mine)
            self.expected.acquire(theirs)
            self.compare_states(f"{now}: after acquire(block {theirs.block_number})", "acquire")
        mine_table, theirs_table = list(mine_found), list(theirs_found)
        for _ in range(num_new):
            mine, theirs = self.allocate(now)
            mine_table.append(mine)
            theirs_table.append(theirs)
        self.seqs[seq_id] = (tokens, mine_table, theirs_table)
        self.name(seq_id, now)
        self.log.append(f"admit s{seq_id} {tokens} -> blocks "
                        f"{[b.block_number for b in theirs_table]}")

    def grow(self, seq_id: int) -> None:
        tokens, mine_table, theirs_table = self.seqs[seq_id]
        new = [self.rng.randrange(3) for _ in range(self.rng.randint(1, self.block_size))]
        needed = -(-(len(tokens) + len(new)) // self.block_size) - len(theirs_table)
        if needed > self.expected.get_num_free_blocks():
            return
        now = f"s{seq_id} appends {new}"
        tokens.extend(new)
        for _ in range(needed):
            mine, theirs = self.allocate(now)
            mine_table.append(mine)
            theirs_table.append(theirs)
        self.name(seq_id, now)
        self.log.append(now)

    def finish(self, seq_id: int) -> None:
        _, mine_table, theirs_table = self.seqs.pop(seq_id)
        now = f"free s{seq_id} (its blocks last first)"
        for mine, theirs in zip(reversed(mine_table), reversed(theirs_table)):
            self.yours.free(mine)
            self.expected.free(theirs)
            self.compare_states(f"{now}: after free(block {theirs.block_number})", "free")
        self.log.append(now)

    def reset(self) -> None:
        """Every sequence freed, then ``reset_prefix_cache``."""
        for seq_id in sorted(self.seqs):
            self.finish(seq_id)
        now, hint = "reset_prefix_cache()", OPERATION_HINTS["reset"]
        try:
            mine = self.yours.reset_prefix_cache()
        except TypeError as error:  # e.g. a helper called with an argument it does not take
            fail("PrefixCachingAllocator", self.case, self.inputs(now), f"TypeError: {error}",
                 "True", hint)
        self.same(now, mine, self.expected.reset_prefix_cache(), hint)
        self.compare_states(f"{now}: after it", "reset")
        self.log.append(now)

    def swap_out(self, seq_id: int) -> None:
        """As the block manager swaps a sequence out: each block's KV copied to a CPU block
        (``copy_contents``), then the GPU block freed."""
        tokens, mine_table, theirs_table = self.seqs.pop(seq_id)
        now = f"swap out s{seq_id}"
        mine_cpu, theirs_cpu = [], []
        for mine, theirs in zip(mine_table, theirs_table):
            mine_copy, theirs_copy = self.cpu_yours.allocate(), self.cpu_expected.allocate()
            self.yours.copy_contents(mine, mine_copy)
            self.expected.copy_contents(theirs, theirs_copy)
            self.same(f"{now}: copy_contents(block {theirs.block_number}, CPU block "
                      f"{theirs_copy.block_number}), then block_hash_of(the CPU block)",
                      self.yours.block_hash_of(mine_copy),
                      self.expected.block_hash_of(theirs_copy), OPERATION_HINTS["copy_contents"])
            self.compare_states(f"{now}: after copy_contents(block {theirs.block_number})",
                                "copy_contents")
            self.yours.free(mine)
            self.expected.free(theirs)
            self.compare_states(f"{now}: after free(block {theirs.block_number})", "free")
            mine_cpu.append(mine_copy)
            theirs_cpu.append(theirs_copy)
        self.swapped[seq_id] = (tokens, mine_cpu, theirs_cpu)
        self.log.append(now)

    def swap_in(self, seq_id: int) -> None:
        """As the block manager swaps a sequence in: a block still cached with the same KV is
        taken (``find_equal``, ``acquire``), else a block is allocated and ``adopt``s the copy."""
        tokens, mine_cpu, theirs_cpu = self.swapped[seq_id]
        if self.expected.get_num_free_blocks() < len(theirs_cpu):
            return
        del self.swapped[seq_id]
        now = f"swap in s{seq_id}"
        mine_table, theirs_table = [], []
        for mine_copy, theirs_copy in zip(mine_cpu, theirs_cpu):
            what = f"{now}: find_equal(CPU block {theirs_copy.block_number})"
            mine, theirs = self.yours.find_equal(mine_copy), self.expected.find_equal(theirs_copy)
            self.same(what, None if mine is None else mine.block_number,
                      None if theirs is None else theirs.block_number,
                      OPERATION_HINTS["find_equal"])
            if theirs is not None:
                self.yours.acquire(mine)
                self.expected.acquire(theirs)
                self.compare_states(f"{now}: after acquire(block {theirs.block_number})",
                                    "acquire")
            else:
                mine, theirs = self.allocate(now)
                self.yours.adopt(mine, mine_copy)
                self.expected.adopt(theirs, theirs_copy)
                self.compare_states(f"{now}: after adopt(block {theirs.block_number}, CPU block "
                                    f"{theirs_copy.block_number})", "adopt")
            self.cpu_yours.free(mine_copy)
            self.cpu_expected.free(theirs_copy)
            mine_table.append(mine)
            theirs_table.append(theirs)
        self.seqs[seq_id] = (tokens, mine_table, theirs_table)
        self.log.append(now + f" -> blocks {[b.block_number for b in theirs_table]}")

    def run(self, num_ops: int) -> None:
        next_id = 0
        for _ in range(num_ops):
            roll = self.rng.random()
            if not self.seqs or roll < 0.4:
                self.admit(next_id)
                next_id += 1
            elif roll < 0.6:
                self.grow(self.rng.choice(sorted(self.seqs)))
            elif roll < 0.7 and self.swapped:
                self.swap_in(self.rng.choice(sorted(self.swapped)))
            elif roll < 0.8:
                self.swap_out(self.rng.choice(sorted(self.seqs)))
            else:
                self.finish(self.rng.choice(sorted(self.seqs)))
        for seq_id in sorted(self.swapped):
            self.swap_in(seq_id)
        if self.seqs:  # a reset with blocks held changes nothing
            now = "reset_prefix_cache() while blocks are held"
            self.same(now, self.yours.reset_prefix_cache(), self.expected.reset_prefix_cache(),
                      OPERATION_HINTS["reset"])
            self.compare_states(f"{now}: after it", "reset")
        self.reset()


def check_prefix_caching_allocator(candidate, rng, num_cases: int) -> int:
    for case in range(num_cases):
        _Workload(candidate, rng, case).run(num_ops=rng.randint(4, 24))
    return num_cases
