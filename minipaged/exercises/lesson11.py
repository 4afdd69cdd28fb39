"""Lesson 11 exercises: the name of a full block, and how much of a prompt the cache serves.

    block_hash(parent_hash, token_ids) -> int
        the name of a full block: the same for the same (parent, tokens), whether the tokens
        come as a list or a tuple; different when a token, the order of the tokens or the parent
        changes (the parent's name stands for every token before the block)
    cached_tokens(prompt, cached_names, block_size) -> int
        how many of the prompt's first tokens a new request takes from the cache, where
        ``cached_names`` is the set of block names (``block_hash``) the cache holds:
        the longest run of full blocks from the start whose names are cached. The block holding
        the prompt's last token is never taken (that token is computed, to sample from it).

Expected answers: properties any good name must have (many names are right) for the first; a
real ``PrefixCachingAllocator`` filled with random earlier prompts for the second.

The build track's component (``minipaged.exercises.workbench``):

    PrefixCachingAllocator
        the learner writes the core methods of ``MyPrefixCachingAllocator`` (allocate, free,
        lookup, longest_cached_prefix, acquire, name_blocks, _name_block, _evict); the checker
        runs random workloads with shared prefixes, frees and evictions on it and on the
        package's allocator side by side (same blocks, same hits, same names, same eviction
        order), and the block manager builds it once it passed.
"""
from __future__ import annotations

from collections.abc import Sequence

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.prefix_caching_allocator import (BlockContents, PrefixCachingAllocator,
                                                      block_hash)
from minipaged.exercises import checking, workbench
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, not_done, passed,
                                          rng_for)
from minipaged.exercises.prefix_cache_hints import (NAMING_EVICTS, OPERATION_HINTS,
                                                    STATE_HINTS, kept_a_name)


@exercise
def check_block_hash(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("block_hash", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        size = rng.choice([1, 2, 4, 16])
        tokens = [rng.randrange(50_000) for _ in range(size)]
        parent = None if case % 3 == 0 else learner(None, [rng.randrange(50_000)] * 4)
        inputs = f"parent_hash={parent!r}, token_ids={tokens}"
        name = learner(parent, tuple(tokens))
        if not isinstance(name, int) or isinstance(name, bool):
            fail(learner.name, case, inputs, name, "an int",
                 "a name is an int; Python turns any hashable value into one (a list is not "
                 "hashable)")
        if learner(parent, list(tokens)) != name:
            fail(learner.name, case, inputs + " (as a list)", learner(parent, list(tokens)), name,
                 "the same tokens must get the same name whether they come as a list or a tuple")
        changed = list(tokens)
        changed[rng.randrange(size)] += 1
        if learner(parent, tuple(changed)) == name:
            fail(learner.name, case, f"parent_hash={parent!r}, token_ids={changed}", name,
                 "a different name", "changing one token must change the name")
        if size > 1 and len(set(tokens)) > 1:
            swapped = tokens[1:] + tokens[:1]
            if learner(parent, tuple(swapped)) == name:
                fail(learner.name, case, f"parent_hash={parent!r}, token_ids={swapped}", name,
                     "a different name", "the order of the tokens matters: the same tokens in "
                     "another order give other keys and values (positions differ)")
        other_parent = learner(None, [50_001 + case] * 4)
        if learner(other_parent, tuple(tokens)) == name:
            fail(learner.name, case, f"parent_hash={other_parent!r}, token_ids={tokens}", name,
                 "a different name", "the parent's name must be part of the block's name: the "
                 "same tokens after a different prefix have different K/V")
    return passed(learner, num_cases)


def _cache_with_prompts(rng, prompts: list[list[int]],
                        block_size: int) -> PrefixCachingAllocator:
    """A real prefix cache whose blocks hold the full blocks of ``prompts``."""
    cache = PrefixCachingAllocator(Device.GPU, block_size, 512)
    for prompt in prompts:
        token_ids = [prompt[i * block_size:(i + 1) * block_size]
                     for i in range(len(prompt) // block_size)]
        cache.name_blocks([cache.allocate() for _ in token_ids], token_ids)
    return cache


@exercise
def check_cached_tokens(fn, num_cases: int = 150, seed: int | None = 0) -> CheckResult:
    learner = Learner("cached_tokens", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        block_size = rng.choice([1, 2, 4, 8])
        system = [rng.randrange(100) for _ in range(rng.randint(0, 4 * block_size))]
        earlier = [system + [rng.randrange(100) for _ in range(rng.randint(0, 3 * block_size))]
                   for _ in range(rng.randint(0, 3))]
        prompt = (rng.choice(earlier) if earlier and case % 4 == 0 else
                  system + [rng.randrange(100) for _ in range(rng.randint(1, 3 * block_size))])
        if case % 5 == 0 and len(prompt) > block_size:  # a hole: a middle block not cached
            earlier.append(prompt[:block_size] + [100 + case] * block_size
                           + prompt[2 * block_size:])
        cache = _cache_with_prompts(rng, earlier, block_size)
        expected = block_size * len(cache.longest_cached_prefix(
            prompt, (len(prompt) - 1) // block_size))
        names = set(cache.by_hash)
        got = learner(list(prompt), set(names), block_size)
        if got != expected:
            hint = ("the cache knows a block only by its name, and a block's name stands "
                    "for every token before it too")
            if got == block_size * len(cache.longest_cached_prefix(
                    prompt, len(prompt) // block_size)):
                hint = ("the block holding the prompt's last token is never taken from the "
                        "cache: that token must be computed to have logits to sample from")
            elif got > expected:
                hint = ("stop at the first block whose name is not cached: a later block's name "
                        "only counts after every block before it")
            elif got < expected:
                hint = ("the names form a chain: each block is named after its parent's name "
                        "and its own tokens, and the first block has no parent")
            fail(learner.name, case, f"prompt={prompt}, cached_names=<{len(names)} names>, "
                 f"block_size={block_size}", got, expected, hint)
    return passed(learner, num_cases)


def usable(fn):
    """``fn`` for the engine to name blocks with once its check passed; until then the package's
    ``prefix_caching_allocator.block_hash``."""
    return checking.usable("block_hash", fn, block_hash)


# -- the build track: the allocator itself -----------------------------------------------------
class MyPrefixCachingAllocator(PrefixCachingAllocator):
    """The GPU pool's allocator with a cache of named full blocks: write the core methods.

    Inherited from the package (use them): ``__init__`` sets up ``free_blocks`` (a stack: pop
    from the end), ``contents`` (block number -> ``BlockContents``: name, token ids,
    content_id, parent_id), ``by_hash`` (name -> the cached block), ``evictable`` (an
    ``OrderedDict`` block number -> block, least recently used first), ``hash_fn``,
    ``_content_ids`` (``next(...)`` gives a new content id) and ``num_evictions``;
    ``is_cached(block)``, ``block_hash_of(block)`` and
    ``_same_contents(block, parent, token_ids)`` (does ``block`` hold ``token_ids`` right after
    ``parent``'s prefix?) read them.
    """

    def allocate(self) -> PhysicalTokenBlock:
        """A block with ref count 1: a truly free one if any, else the least recently used
        evictable block, evicted first (``_evict``); ``ValueError`` when neither is left."""
        not_done()  # <- your code here

    def free(self, block: PhysicalTokenBlock) -> None:
        """Drop one reference. A *cached* block nobody holds any more keeps its KV and its name
        and becomes evictable (the most recently used); any other block nobody holds returns to
        the free list and forgets what it held (``contents``)."""
        not_done()  # <- your code here

    def lookup(self, parent: PhysicalTokenBlock | None,
               token_ids: tuple[int, ...]) -> PhysicalTokenBlock | None:
        """The cached block holding ``token_ids`` right after ``parent``'s prefix, or None.
        A hash hit is only a hint: confirm it."""
        not_done()  # <- your code here

    def longest_cached_prefix(self, token_ids: Sequence[int],
                              max_blocks: int) -> list[PhysicalTokenBlock]:
        """The cached blocks of the longest run of full blocks of ``token_ids`` from the start
        (at most ``max_blocks``): each found by its name, after the one found before it."""
        not_done()  # <- your code here

    def acquire(self, block: PhysicalTokenBlock) -> None:
        """One more block table holds ``block``: its ref count grows by one (an evictable block
        is taken back)."""
        not_done()  # <- your code here

    def name_blocks(self, blocks: Sequence[PhysicalTokenBlock],
                    token_ids: Sequence[Sequence[int]]) -> None:
        """``blocks[i]`` holds the full block of tokens ``token_ids[i]`` right after
        ``blocks[i - 1]`` (one sequence's blocks from its first): name those not named yet
        (``_name_block``), so that later prompts starting with the same tokens find them."""
        not_done()  # <- your code here

    def _name_block(self, block: PhysicalTokenBlock, parent: PhysicalTokenBlock | None,
                    token_ids: tuple[int, ...]) -> None:
        """Give ``block`` its name (``BlockContents``), and cache it (``by_hash``) unless an
        equal block already is; an evictable block holding another prefix under the same name
        is evicted, a block in use keeps its name (this one stays private)."""
        not_done()  # <- your code here

    def _evict(self, block: PhysicalTokenBlock, counted: bool = True) -> None:
        """An evictable block loses its name and goes to the free list, to be reused.
        ``counted``: an eviction for room (``num_evictions``); the inherited
        ``reset_prefix_cache`` calls ``_evict(block, counted=False)`` for each evictable block."""
        not_done()  # <- your code here


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
        evicting = not self.expected.free_blocks
        mine, theirs = self.yours.allocate(), self.expected.allocate()
        hint = ("when the free list is empty, allocate evicts the least recently used "
                "evictable block (the front of evictable) and hands it out" if evicting else
                "allocate takes a truly free block first (the free list is a stack: pop from "
                "its end) and evicts only when the free list is empty")
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
                        "ids right after the block found before it (_same_contents)")
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
        """Every sequence freed, then the inherited ``reset_prefix_cache`` (it calls your
        ``_evict(block, counted=False)``)."""
        for seq_id in sorted(self.seqs):
            self.finish(seq_id)
        now, hint = "reset_prefix_cache()", OPERATION_HINTS["reset"]
        try:
            mine = self.yours.reset_prefix_cache()
        except TypeError as error:  # an _evict without counted
            fail("PrefixCachingAllocator", self.case, self.inputs(now), f"TypeError: {error}",
                 "True", hint)
        self.same(now, mine, self.expected.reset_prefix_cache(), hint)
        self.compare_states(f"{now}: after it", "reset")
        self.log.append(now)

    def run(self, num_ops: int) -> None:
        next_id = 0
        for _ in range(num_ops):
            roll = self.rng.random()
            if not self.seqs or roll < 0.45:
                self.admit(next_id)
                next_id += 1
            elif roll < 0.7:
                self.grow(self.rng.choice(sorted(self.seqs)))
            else:
                self.finish(self.rng.choice(sorted(self.seqs)))
        self.reset()


def _check_prefix_caching_allocator(candidate, rng, num_cases: int) -> int:
    for case in range(num_cases):
        _Workload(candidate, rng, case).run(num_ops=rng.randint(4, 24))
    return num_cases


workbench.register(workbench.Component(
    name="PrefixCachingAllocator", lesson="11",
    slots=("minipaged.core.block_manager:PrefixCachingAllocator",),
    check=_check_prefix_caching_allocator,
    solution="minipaged.exercises.answers.lesson11:MyPrefixCachingAllocator",
    preamble="from minipaged.exercises.lesson11 import *",
))


__all__ = ["check_block_hash", "check_cached_tokens", "usable", "MyPrefixCachingAllocator",
           "PrefixCachingAllocator", "BlockContents", "PhysicalTokenBlock", "Device",
           "block_hash", "not_done", "Sequence"]
