"""Lesson 11 as a learner answers it: full blocks cut by a helper, ``free`` and ``_name_block``
in another order than the reference."""

# %%
def full_blocks(token_ids, block_size, count):
    """The first ``count`` blocks' worth of token ids, as tuples."""
    return [tuple(token_ids[i * block_size:(i + 1) * block_size]) for i in range(count)]


# %%
class MyPrefixCachingAllocator(PrefixCachingAllocator):
    def allocate(self):
        if not self.free_blocks:
            if not self.evictable:
                raise ValueError(f"no free and no evictable block among {self.num_blocks}")
            least_recent = next(iter(self.evictable))
            self._evict(self.evictable[least_recent])
        block = self.free_blocks.pop()
        block.ref_count = 1
        return block

    def free(self, block):
        if block.device != self.device:
            raise ValueError(f"block {block.block_number} is not from the {self.device.value} pool")
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_number} is free already")
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if self.is_cached(block):
            self.evictable[block.block_number] = block  # most recently used: at the end
        else:
            self.free_blocks.append(block)
            self.contents.pop(block.block_number, None)

    def lookup(self, parent, token_ids):
        parent_hash = self.block_hash_of(parent) if parent is not None else None
        hit = self.by_hash.get(self.hash_fn(parent_hash, token_ids))
        if hit is not None and self._same_contents(hit, parent, token_ids):
            return hit
        return None

    def longest_cached_prefix(self, token_ids, max_blocks):
        found = []
        for chunk in full_blocks(token_ids, self.block_size, max_blocks):
            block = self.lookup(found[-1] if found else None, chunk)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, block):
        self.evictable.pop(block.block_number, None)  # back in use
        block.ref_count += 1

    def name_blocks(self, blocks, token_ids):
        for i, block in enumerate(blocks):
            if block.block_number not in self.contents:
                self._name_block(block, blocks[i - 1] if i > 0 else None, tuple(token_ids[i]))

    def _name_block(self, block, parent, token_ids):
        above = self.contents[parent.block_number] if parent is not None else None
        name = self.hash_fn(above.block_hash if above is not None else None, token_ids)
        holder = self.by_hash.get(name)
        same = holder is not None and self._same_contents(holder, parent, token_ids)
        content_id = (self.contents[holder.block_number].content_id if same
                      else next(self._content_ids))
        self.contents[block.block_number] = BlockContents(
            name, token_ids, content_id, above.content_id if above is not None else None)
        if same:
            return  # a private copy of a cached block
        if holder is not None:
            if holder.ref_count > 0:
                return  # another prefix in use has the name
            self._evict(holder)
        self.by_hash[name] = block

    def _evict(self, block, counted=True):
        del self.evictable[block.block_number]
        gone = self.contents.pop(block.block_number)
        del self.by_hash[gone.block_hash]
        self.free_blocks.append(block)
        self.num_evictions += int(counted)
