"""Lesson 11: the hints of ``PrefixCachingAllocator``'s check, each keyed to the cause.

The check (``lesson11._Workload``) compares the learner's allocator with the package's after
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
    "cached blocks": "a named block is cached (by_hash) unless an equal block already is, or "
                     "the name belongs to a block in use; eviction drops the name",
    "evictable blocks (LRU first)": "a cached block whose last reference is freed goes to the "
                                    "end of evictable: the front is the least recently used, "
                                    "evicted first",
    "free blocks (next first)": "a block nobody holds that is not cached goes back on the free "
                                "list (a stack: appended, popped from the end); an evicted "
                                "block goes there too",
    "free count": "get_num_free_blocks: evictable blocks still count as free (they can be "
                  "evicted for room)",
    "evictions": "_evict counts an eviction (num_evictions) each time a cached block loses its "
                 "name for room",
}
# after a name_blocks call, what a wrong eviction shows (naming can evict an evictable block)
NAMING_EVICTS = ("_name_block: an evictable block holding another prefix under the same name "
                  "is evicted (it loses its name and goes to the free list, one eviction more); "
                  "a block in use keeps its name, and the new one stays private")
# the operation that ran when the states first differed -> its hint (the cause, whatever the
# field where the difference shows)
OPERATION_HINTS = {
    "free": "free drops ONE reference; a cached block nobody holds any more keeps its KV and "
            "its name and goes to the end of evictable (the most recently used); any other "
            "block nobody holds goes back on the free list and forgets what it held (contents)",
    "acquire": "acquire adds one reference; a block nobody held (ref count 0) was evictable: "
               "it is in use again, so it is taken off evictable (it must not be evicted "
               "while a table holds it)",
    "reset": "reset_prefix_cache (inherited) evicts every evictable block with "
             "_evict(block, counted=False): each loses its name and goes to the free list; "
             "counted=True is an eviction for room (num_evictions), a reset is not counted",
    "allocate": "allocate takes a truly free block first (pop from the end of the free list); "
                "only when none is left does it evict the least recently used evictable block "
                "(_evict: the block loses its name, leaves by_hash and contents, one eviction "
                "more) and hand it out with ref count 1",
}
