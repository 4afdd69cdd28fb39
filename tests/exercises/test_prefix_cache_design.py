"""Lesson 11 leaves the prefix cache's data structures to the learner: its check compares only
behaviour, and its cost check catches a poor choice. Each variant below is correct (the check
passes it) but keeps its state in a structure whose cost grows with the number of cached blocks,
as a learner might: the cost check warns, naming the operation that pays for it."""
import pytest

from minipaged.exercises import workbench
from minipaged.exercises.answers.lesson11 import MyPrefixCachingAllocator
from cost_verdicts import assert_correct_but_warned


@pytest.fixture(autouse=True)
def _learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))


class LeastRecentlyUsedAsAList(MyPrefixCachingAllocator):
    """The evictable blocks in a plain list, least recently used first: taking one back is a
    ``list.remove``, evicting one a ``pop(0)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.evictable = []

    def allocate(self):
        if not self.free_blocks and self.evictable:
            self._evict(self.evictable[0])
        return super().allocate()

    def free(self, block):
        if block.ref_count == 1 and self.is_cached(block):
            block.ref_count = 0
            self.evictable.append(block)
            return
        super().free(block)

    def acquire(self, block):
        if block.ref_count == 0:
            self.evictable.remove(block)
        block.ref_count += 1

    def evictable_block_numbers(self):
        return [b.block_number for b in self.evictable]

    def free_block_numbers(self):
        return [b.block_number for b in reversed(self.free_blocks)] + \
            self.evictable_block_numbers()

    def reset_prefix_cache(self):
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in list(self.evictable):
            self._evict(block, counted=False)
        return True

    def _evict(self, block, counted=True):
        self.evictable.remove(block)
        name = self.contents.pop(block.block_number).block_hash
        del self.by_hash[name]
        self.num_evictions += counted
        self.free_blocks.append(block)


class OldestByTimestamp(MyPrefixCachingAllocator):
    """Each evictable block remembers when it was freed; eviction takes ``min()`` over them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.freed_at, self.clock = {}, 0

    def allocate(self):
        if not self.free_blocks and self.evictable:
            oldest = min(self.evictable, key=self.freed_at.__getitem__)
            self._evict(self.evictable[oldest])
        return super().allocate()

    def free(self, block):
        self.clock += 1
        self.freed_at[block.block_number] = self.clock
        super().free(block)


class LookupScansTheCache(MyPrefixCachingAllocator):
    """Finds a name by walking every cached block, not by the name itself."""

    def lookup(self, parent, token_ids):
        name = self.hash_fn(None if parent is None else self.block_hash_of(parent), token_ids)
        for block in self.blocks:
            if self.is_cached(block) and self.block_hash_of(block) == name:
                return block if self._same_contents(block, parent, token_ids) else None
        return None


@pytest.mark.parametrize("variant, operation", [
    (LeastRecentlyUsedAsAList, "acquire + free of a cached block"),
    (OldestByTimestamp, "evict + name + free"),
    (LookupScansTheCache, "lookup"),
])
def test_a_correct_cache_in_a_poor_structure_passes_the_check_and_gets_the_cost_warning(
        variant, operation):
    assert_correct_but_warned("PrefixCachingAllocator", variant, operation, "cached blocks")


def test_the_stub_dictates_no_structure():
    """The stub names the interface, never a structure to fill."""
    from minipaged.exercises import lesson11

    doc = "".join(getattr(lesson11.MyPrefixCachingAllocator, name).__doc__ or ""
                  for name in vars(lesson11.MyPrefixCachingAllocator)
                  if callable(getattr(lesson11.MyPrefixCachingAllocator, name)))
    doc += lesson11.MyPrefixCachingAllocator.__doc__
    for attribute in ("free_blocks", "evictable", "by_hash", "contents", "_content_ids"):
        assert f"``{attribute}``" not in doc and f"self.{attribute}" not in doc, attribute
    for name in ("OrderedDict", "BlockContents", "_evict(", "_name_block", "_same_contents"):
        assert name not in doc, name
