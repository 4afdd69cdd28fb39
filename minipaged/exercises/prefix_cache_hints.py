"""Lesson 11: the hints of ``PrefixCachingAllocator``'s check, each keyed to the cause.

The check (``prefix_cache_check._Workload``) compares the learner's allocator with the package's after
every operation (``_allocator_state``); the operation that ran picks the hint (free, acquire,
allocate, a reset), whichever field shows the difference; after a ``name_blocks`` the field does
(a name kept, or an evictable or free list that differs, points at the eviction that naming does).
"""
from __future__ import annotations


def kept_a_name(mine: list, theirs: list) -> bool:
    """Does a block keep a name (``mine``) that the package's lost (``theirs``): an eviction
    that did not happen?"""
    return any(t is None and m is not None for m, t in zip(mine, theirs))


STATE_HINTS = {
    "ref counts": "acquire adds one reference; free drops one, and a block nobody holds is "
                  "either evictable (cached) or free",
    "names": "a block's name is hash_fn(its parent's name, its own tokens), the first block's "
             "parent name is None: the parent's name stands for every token before the block",
    "cached blocks": "a named block is cached (found under its name) unless a block with the "
                     "same KV already is, or the name belongs to a block in use; eviction "
                     "drops the name",
    "evictable blocks (LRU first)": "a cached block whose last reference is dropped becomes "
                                    "the most recently used evictable block; the least "
                                    "recently used one is evicted first",
    "free blocks (next first)": "a block nobody holds that is not cached is truly free, and "
                                "the truly free blocks are handed out last freed first (an "
                                "evicted block counts as freed when it is evicted), before "
                                "the evictable ones",
    "free count": "get_num_free_blocks: evictable blocks still count as free (they can be "
                  "evicted for room)",
    "evictions": "num_evictions counts each time a cached block loses its name for room (to "
                 "allocate, or for another prefix's block under the same name), never a reset",
}
# after a name_blocks call, what a wrong eviction shows (naming can evict an evictable block)
NAMING_EVICTS = ("naming a block: an evictable block holding another prefix under the same name "
                  "is evicted (it loses its name and becomes truly free, one eviction more); "
                  "a block in use keeps its name, and the new one stays private")
# the operation that ran when the states first differed -> its hint (the cause, whatever the
# field where the difference shows)
OPERATION_HINTS = {
    "free": "free drops ONE reference; a cached block nobody holds any more keeps its KV and "
            "its name and becomes the most recently used evictable block; any other block "
            "nobody holds becomes truly free and forgets what it held (no name any more)",
    "acquire": "acquire adds one reference; a block nobody held (ref count 0) was evictable: "
               "it is in use again, so it is taken off evictable (it must not be evicted "
               "while a table holds it)",
    "reset": "reset_prefix_cache, when no block is held, makes every evictable block lose its "
             "name and become truly free; a reset is not an eviction for room (num_evictions "
             "stays as it was); with a block held it changes nothing and returns False",
    "allocate": "allocate takes a truly free block first (the one freed last); only when none "
                "is left does it evict the least recently used evictable block (the block "
                "loses its name and is no longer cached, one eviction more) and hand it out "
                "with ref count 1",
    "copy_contents": "copy_contents(src, dst): the swap-space block dst carries src's name "
                     "(block_hash_of(dst)) while it is held, and is never cached; a copy of a "
                     "block without a name has none",
    "find_equal": "find_equal(copy) gives the cached block that still holds the very KV copied "
                  "to copy: not when that block was evicted since, or when another prefix's "
                  "block is cached under the name now",
    "adopt": "adopt(block, copy): block takes the copy's name and KV back, and is cached "
             "unless another block is cached under that name by now",
}
