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
        the learner writes ``MyPrefixCachingAllocator`` whole: its state (the stub says what
        must hold, never how to store it) and every method of the allocator's interface; the
        checker runs random workloads with shared prefixes, frees, evictions, swaps and resets
        on it and on the package's allocator side by side, and compares only what the
        interface shows (blocks handed out and found, ref counts, names, what is cached, the
        evictable and free orders, counts); the cost check (``cost_probes``) fills it with
        50,000 cached blocks; the block manager builds it once it passed.
"""
from __future__ import annotations

from collections.abc import Sequence

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.allocator import BlockAllocator
from minipaged.core.prefix_caching_allocator import (BlockContents, PrefixCachingAllocator,
                                                      block_hash)
from minipaged.exercises import checking, workbench
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, not_done, passed,
                                          rng_for)
from minipaged.exercises.prefix_cache_check import check_prefix_caching_allocator


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
        names = {cache.block_hash_of(b) for b in cache.blocks if cache.is_cached(b)}
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
class MyPrefixCachingAllocator(BlockAllocator):
    """The GPU pool's allocator with a cache of named full blocks. How you keep its state is
    yours to choose: write ``__init__`` and every method below. Only what each one does and
    returns is checked, against the package's allocator, operation by operation.

    What must hold:

    - A block is *free* when no block table holds it (ref count 0). A free block is either
      *evictable* (it is cached: it keeps its KV and its name and can be found and taken back)
      or *truly free*. Both count as free.
    - Truly free blocks are handed out last freed first (block 0 first in a new pool);
      evictable blocks leave by eviction, least recently used first: the one whose last
      reference was dropped longest ago (taking a block back and freeing it again makes it
      the most recently used). An evicted block counts as freed when it is evicted.
    - A block's *name* is ``self.hash_fn(its parent's name, its token ids)``, the first
      block's parent name ``None``; ``hash_fn`` may be replaced after ``__init__`` (read it at
      each use). A name is only a hash: a block is found for a prompt only if it holds the
      same token ids right after the same KV (a block computed again for an equal prefix holds
      the same KV as the first one).
    - Ask yourself how each operation's cost grows with the number of cached blocks: the cost
      check fills the cache with 50,000 of them.
    """

    def __init__(self, device: Device, block_size: int, num_blocks: int,
                 hash_fn=block_hash) -> None:
        """A pool of ``num_blocks`` blocks, all truly free, nothing named. Public attributes
        (the block manager and the pictures read them): ``device``, ``block_size``,
        ``num_blocks``, ``blocks`` (``PhysicalTokenBlock(device, i, block_size)`` for each
        block number ``i``), ``hash_fn`` and ``num_evictions`` (0)."""
        not_done()  # <- your code here (and the state you choose)

    def allocate(self) -> PhysicalTokenBlock:
        """A block with ref count 1: a truly free one if any; else the least recently used
        evictable block, evicted first (it loses its name, one eviction more); ``ValueError``
        when no block is free."""
        not_done()  # <- your code here

    def free(self, block: PhysicalTokenBlock) -> None:
        """Drop one reference (``ValueError`` for a block of another pool or one nobody
        holds). A *cached* block nobody holds any more keeps its KV and its name and becomes
        evictable, the most recently used; any other block nobody holds becomes truly free and
        forgets what it held (it has no name any more)."""
        not_done()  # <- your code here

    def acquire(self, block: PhysicalTokenBlock) -> None:
        """One more block table holds ``block``: its ref count grows by one (an evictable
        block is in use again: it is no longer evictable)."""
        not_done()  # <- your code here

    def get_num_free_blocks(self) -> int:
        """How many blocks ``allocate`` can still hand out: truly free and evictable."""
        not_done()  # <- your code here

    def free_block_numbers(self) -> list[int]:
        """The free blocks in the order ``allocate`` will hand them out: the truly free ones,
        then the evictable ones, least recently used first."""
        not_done()  # <- your code here

    def evictable_block_numbers(self) -> list[int]:
        """The evictable blocks, least recently used (the next to be evicted) first."""
        not_done()  # <- your code here

    def lookup(self, parent: PhysicalTokenBlock | None,
               token_ids: tuple[int, ...]) -> PhysicalTokenBlock | None:
        """The cached block holding ``token_ids`` right after ``parent``'s prefix (``None``:
        the first block of a sequence), or None."""
        not_done()  # <- your code here

    def longest_cached_prefix(self, token_ids: Sequence[int],
                              max_blocks: int) -> list[PhysicalTokenBlock]:
        """The cached blocks of the longest run of full blocks of ``token_ids`` from the start
        (at most ``max_blocks``), each found with ``self.lookup`` after the one found before
        it (the hybrid models of lesson 20 change what ``lookup`` finds). Nothing is taken:
        ref counts stay as they are."""
        not_done()  # <- your code here

    def name_blocks(self, blocks: Sequence[PhysicalTokenBlock],
                    token_ids: Sequence[Sequence[int]]) -> None:
        """``blocks[i]`` holds the full block of tokens ``token_ids[i]`` right after
        ``blocks[i - 1]`` (one sequence's blocks from its first; the first ones may be named
        already): give the others their names. A newly named block is cached, unless a block
        holding the same KV is cached already, or the name is taken by a cached block in use
        (then it stays private: named, not cached). A cached *evictable* block holding another
        prefix under the same name is evicted (one eviction more) and the new block cached."""
        not_done()  # <- your code here

    def reset_prefix_cache(self) -> bool:
        """When no block is held: every evictable block loses its name and becomes truly free
        (this is not an eviction for room: ``num_evictions`` stays), returns True; else changes
        nothing and returns False."""
        not_done()  # <- your code here

    def copy_contents(self, src: PhysicalTokenBlock, dst: PhysicalTokenBlock) -> None:
        """Swapping out: ``dst`` (a block of the CPU pool, held) now holds a copy of ``src``'s
        KV. It carries ``src``'s name (``block_hash_of(dst)``, while ``dst`` is held), but is
        never cached; a copy of an unnamed block has no name."""
        not_done()  # <- your code here

    def find_equal(self, copy: PhysicalTokenBlock) -> PhysicalTokenBlock | None:
        """Swapping in: the cached block of this pool that still holds the very KV that was
        copied to ``copy`` (not evicted since, not replaced under its name), or None."""
        not_done()  # <- your code here

    def adopt(self, block: PhysicalTokenBlock, copy: PhysicalTokenBlock) -> None:
        """Swapping in: ``block`` (just allocated) received ``copy``'s KV. It takes that
        name and KV back, and is cached unless another block is cached under the name."""
        not_done()  # <- your code here

    def block_hash_of(self, block: PhysicalTokenBlock) -> int | None:
        """The name of what ``block`` holds (a block of this pool, or a held swap-space copy),
        or None."""
        not_done()  # <- your code here

    def is_cached(self, block: PhysicalTokenBlock) -> bool:
        """Is ``block`` the block this pool's cache finds under its name?"""
        not_done()  # <- your code here


workbench.register(workbench.Component(
    name="PrefixCachingAllocator", lesson="11",
    slots=("minipaged.core.block_manager:PrefixCachingAllocator",),
    check=check_prefix_caching_allocator,
    solution="minipaged.exercises.answers.lesson11:MyPrefixCachingAllocator",
    preamble="from minipaged.exercises.lesson11 import *",
))


__all__ = ["check_block_hash", "check_cached_tokens", "usable", "MyPrefixCachingAllocator",
           "PrefixCachingAllocator", "BlockAllocator", "BlockContents", "PhysicalTokenBlock", "Device",
           "block_hash", "not_done", "Sequence"]
