"""The block manager as plain data: what the visualizer draws and tests read (lessons 02-07).

Keys of ``snapshot_block_manager(bm)``:

- ``sequences``: per sequence its id, request, status, device, length, logical blocks (filled
  slots and token ids) and block table;
- ``gpu_blocks`` / ``cpu_blocks``: per physical block its ref count, owners (sequence ids), name
  (``block_hash``), whether the prefix cache hands it out (``cached``) and whether it is cached
  but held by nobody (``evictable``: it counts as free);
- ``free_gpu_blocks`` / ``free_cpu_blocks``: the free lists, next to be allocated first;
- ``evictable_gpu_blocks``, ``prefix_caching``, ``block_size``, ``watermark_blocks``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from minipaged.core.allocator import BlockAllocator
from minipaged.block import Device

if TYPE_CHECKING:
    from minipaged.core.block_manager import BlockSpaceManager


def snapshot_block_manager(bm: BlockSpaceManager) -> dict:
    """Plain data describing every table and block of ``bm`` (the keys are listed above)."""
    sequences = []
    owners = {Device.GPU: {}, Device.CPU: {}}
    for seq_id, table in bm.block_tables.items():
        seq = bm.seqs[seq_id]
        device = table[0].device if table else Device.GPU
        sequences.append({
            "seq_id": seq_id,
            "request_id": bm.seq_request.get(seq_id),
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

    names = bm.gpu_allocator  # what the prefix cache (if any) calls each block

    def pool(allocator: BlockAllocator) -> list[dict]:
        return [{"block_number": b.block_number, "ref_count": b.ref_count,
                 "owners": owners[allocator.device].get(b.block_number, []),
                 "block_hash": names.block_hash_of(b), "cached": names.is_cached(b),
                 "evictable": names.is_cached(b) and b.ref_count == 0}
                for b in allocator.blocks]

    return {
        "block_size": bm.block_size,
        "watermark_blocks": bm.watermark_blocks,
        "sequences": sequences,
        "gpu_blocks": pool(bm.gpu_allocator),
        "cpu_blocks": pool(bm.cpu_allocator),
        "free_gpu_blocks": bm.gpu_allocator.free_block_numbers(),
        "free_cpu_blocks": bm.cpu_allocator.free_block_numbers(),
        # Cached blocks nobody holds, next to be evicted first (they are in the free list
        # too, after the truly free blocks).
        "evictable_gpu_blocks": bm.gpu_allocator.evictable_block_numbers(),
        "prefix_caching": bm.enable_prefix_caching,
    }
