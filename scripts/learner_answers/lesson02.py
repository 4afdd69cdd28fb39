"""Lesson 02 as a learner answers it: the free list kept as block numbers, a helper for the errors."""

# %%
def pool_error(allocator, block, what):
    """The ValueError for a block this pool cannot take back."""
    return ValueError(f"block {block.block_number} ({block.device.value}) {what} "
                      f"(pool: {allocator.device.value}, {allocator.num_blocks} blocks)")


# %%
class MyFreeListAllocator(NoCacheAllocator):
    def __init__(self, device, block_size, num_blocks):
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_evictions = 0
        self.blocks = [PhysicalTokenBlock(device, n, block_size) for n in range(num_blocks)]
        self.free_numbers = list(range(num_blocks))[::-1]  # the top of the stack is the end

    def allocate(self):
        if not self.free_numbers:
            raise ValueError("no free block left")
        block = self.blocks[self.free_numbers.pop()]
        block.ref_count = 1
        return block

    def free(self, block):
        if block.device != self.device:
            raise pool_error(self, block, "is not from this pool")
        if block.ref_count == 0:
            raise pool_error(self, block, "is free already")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_numbers.append(block.block_number)

    def acquire(self, block):
        block.ref_count += 1

    def get_num_free_blocks(self):
        return len(self.free_numbers)

    def free_block_numbers(self):
        return self.free_numbers[::-1]
