"""The block manager as plain data: what the visualizer draws and tests read (lessons 02-07).

Keys of ``snapshot_pools(...)`` (``BlockSpaceManager.snapshot()`` adds ``block_size``,
``watermark_blocks`` and ``prefix_caching``):

- ``sequences``: per sequence its id, request, status, device, length, logical blocks (filled
  slots and token ids) and block table;
- ``gpu_blocks`` / ``cpu_blocks``: per physical block its ref count, owners (sequence ids), name
  (``block_hash``), whether the prefix cache hands it out (``cached``) and whether it is cached
  but held by nobody (``evictable``: it counts as free);
- ``free_gpu_blocks`` / ``free_cpu_blocks``: the free lists, next to be allocated first;
- ``evictable_gpu_blocks``.

NOTE: it reads what the manager hands it, not the manager, so that this module imports nothing of the
block manager's (no import circle, not even one for annotations).
"""
from __future__ import annotations

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.allocator import BlockAllocator
from minipaged.sequence import Sequence


def snapshot_pools(held: list[tuple[Sequence, str, list[PhysicalTokenBlock]]],
                   gpu_allocator: BlockAllocator, cpu_allocator: BlockAllocator) -> dict:
    """Plain data describing every table and block (the keys are listed above).

    Args:
        held: every sequence that holds blocks, with its request id and its physical blocks
            (as the block manager's ``held_sequences`` and ``get_blocks`` give them); listed
            by sequence id.
        gpu_allocator, cpu_allocator: the two pools.
    """
    sequences = []
    owners = {Device.GPU: {}, Device.CPU: {}}
    for seq, request_id, table in sorted(held, key=lambda entry: entry[0].seq_id):
        seq_id = seq.seq_id
        device = table[0].device if table else Device.GPU
        sequences.append({
            "seq_id": seq_id,
            "request_id": request_id,
            "status": seq.status.name,
            "device": device.value,
            "num_tokens": seq.get_len(),
            "logical_blocks": [
                {"index": b.block_number, "num_filled": b.num_tokens,
                 "token_ids": list(b.token_ids)} for b in seq.logical_token_blocks],
            "block_table": [b.block_number for b in table],
        })
        for block in table:
            owners[block.device].setdefault(block.block_number, []).append(seq_id)

    names = gpu_allocator  # what the prefix cache (if any) calls each block

    def pool(allocator: BlockAllocator) -> list[dict]:
        return [{"block_number": b.block_number, "ref_count": b.ref_count,
                 "owners": owners[allocator.device].get(b.block_number, []),
                 "block_hash": names.block_hash_of(b), "cached": names.is_cached(b),
                 "evictable": names.is_cached(b) and b.ref_count == 0}
                for b in allocator.blocks]

    return {
        "sequences": sequences,
        "gpu_blocks": pool(gpu_allocator),
        "cpu_blocks": pool(cpu_allocator),
        "free_gpu_blocks": gpu_allocator.free_block_numbers(),
        "free_cpu_blocks": cpu_allocator.free_block_numbers(),
        # Cached blocks nobody holds, next to be evicted first (they are in the free list
        # too, after the truly free blocks).
        "evictable_gpu_blocks": gpu_allocator.evictable_block_numbers(),
    }
