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
"""
from __future__ import annotations

from minipaged.block import Device
from minipaged.core.prefix_caching_allocator import PrefixCachingAllocator, block_hash
from minipaged.exercises import checking
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for


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


__all__ = ["check_block_hash", "check_cached_tokens", "usable"]
