"""Lesson 11 as a learner answers it: its own state (a heap of free times with stale entries
skipped instead of an ordered dict, tuples instead of a record class, a kv id per block), full
blocks cut by a helper, the oldest evictable block found by another helper."""

# %%
import heapq
import itertools


def full_blocks(token_ids, block_size, count):
    """The first ``count`` blocks' worth of token ids, as tuples."""
    return [tuple(token_ids[i * block_size:(i + 1) * block_size]) for i in range(count)]


# %%
def pop_oldest(heap, freed_at):
    """The block number freed longest ago among ``freed_at``, taken out of it (stale heap
    entries skipped)."""
    while True:
        stamp, number = heapq.heappop(heap)
        if freed_at.get(number) == stamp:
            del freed_at[number]
            return number


# %%
class MyPrefixCachingAllocator(BlockAllocator):
    def __init__(self, device, block_size, num_blocks, hash_fn=block_hash):
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.hash_fn = hash_fn
        self.num_evictions = 0
        self.spare = [self.blocks[i] for i in range(num_blocks - 1, -1, -1)]  # pop() -> block 0
        self.held_kv = {}   # block number -> (name, tokens, kv id, parent's kv id)
        self.copies = {}    # CPU block number -> the same, for a swapped-out copy
        self.cached = {}    # name -> block
        self.freed_at = {}  # evictable block number -> when it was freed
        self.heap = []      # (when, block number), stale entries included
        self.clock = itertools.count()
        self.kv_ids = itertools.count()

    def allocate(self):
        if not self.spare:
            if not self.freed_at:
                raise ValueError(f"no free and no evictable block among {self.num_blocks}")
            self.drop_name(self.blocks[pop_oldest(self.heap, self.freed_at)])
        block = self.spare.pop()
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
            stamp = next(self.clock)
            self.freed_at[block.block_number] = stamp
            heapq.heappush(self.heap, (stamp, block.block_number))
            if len(self.heap) > 2 * len(self.freed_at) + 64:  # too many stale entries
                self.heap = [(s, n) for n, s in self.freed_at.items()]
                heapq.heapify(self.heap)
        else:
            self.spare.append(block)
            self.held_kv.pop(block.block_number, None)

    def acquire(self, block):
        self.freed_at.pop(block.block_number, None)  # back in use (its heap entry goes stale)
        block.ref_count += 1

    def get_num_free_blocks(self):
        return len(self.spare) + len(self.freed_at)

    def evictable_block_numbers(self):
        return sorted(self.freed_at, key=self.freed_at.get)

    def free_block_numbers(self):
        return [b.block_number for b in reversed(self.spare)] + self.evictable_block_numbers()

    def lookup(self, parent, token_ids):
        parent_name = self.block_hash_of(parent) if parent is not None else None
        hit = self.cached.get(self.hash_fn(parent_name, token_ids))
        if hit is not None and self.same_kv(hit, parent, token_ids):
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

    def name_blocks(self, blocks, token_ids):
        for i, block in enumerate(blocks):
            if block.block_number not in self.held_kv:
                self.name_one(block, blocks[i - 1] if i > 0 else None, tuple(token_ids[i]))

    def name_one(self, block, parent, token_ids):
        above = self.held_kv[parent.block_number] if parent is not None else None
        name = self.hash_fn(above[0] if above is not None else None, token_ids)
        holder = self.cached.get(name)
        same = holder is not None and self.same_kv(holder, parent, token_ids)
        kv_id = self.held_kv[holder.block_number][2] if same else next(self.kv_ids)
        self.held_kv[block.block_number] = (name, token_ids, kv_id,
                                            above[2] if above is not None else None)
        if same:
            return  # a private copy of a cached block
        if holder is not None:
            if holder.ref_count > 0:
                return  # another prefix in use has the name
            self.freed_at.pop(holder.block_number)
            self.drop_name(holder)
        self.cached[name] = block

    def drop_name(self, block, for_room=True):
        """``block`` (no longer evictable) forgets its name and becomes spare."""
        del self.cached[self.held_kv.pop(block.block_number)[0]]
        self.spare.append(block)
        self.num_evictions += int(for_room)

    def reset_prefix_cache(self):
        if self.get_num_free_blocks() < self.num_blocks:
            return False
        for number in self.evictable_block_numbers():
            del self.freed_at[number]
            self.drop_name(self.blocks[number], for_room=False)
        self.heap.clear()
        return True

    def copy_contents(self, src, dst):
        where = self.held_kv if dst.device == self.device else self.copies
        if src.block_number in self.held_kv:
            where[dst.block_number] = self.held_kv[src.block_number]
        else:
            where.pop(dst.block_number, None)

    def find_equal(self, copy):
        kv = self.kv_of(copy)
        if kv is None:
            return None
        holder = self.cached.get(kv[0])
        if holder is not None and self.held_kv[holder.block_number][2] == kv[2]:
            return holder
        return None

    def adopt(self, block, copy):
        kv = self.kv_of(copy)
        if kv is not None:
            self.held_kv[block.block_number] = kv
            if kv[0] not in self.cached:
                self.cached[kv[0]] = block

    def block_hash_of(self, block):
        kv = self.kv_of(block)
        return kv[0] if kv is not None else None

    def is_cached(self, block):
        kv = self.held_kv.get(block.block_number) if block.device == self.device else None
        return kv is not None and self.cached.get(kv[0]) is block

    def kv_of(self, block):
        if block.device == self.device:
            return self.held_kv.get(block.block_number)
        return self.copies.get(block.block_number) if block.ref_count > 0 else None

    def same_kv(self, block, parent, token_ids):
        kv = self.held_kv[block.block_number]
        parent_kv = self.held_kv[parent.block_number][2] if parent is not None else None
        return kv[1] == token_ids and kv[3] == parent_kv
