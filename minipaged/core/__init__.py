"""Bookkeeping without tensors: blocks, allocators, the block manager, the scheduler."""
