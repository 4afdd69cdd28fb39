"""Random paged-attention inputs in the kernels' layout (lessons 05 and 06): a query, key and value
caches whose blocks are handed out in a shuffled order, block tables padded with their first
block, the context lengths and the softmax scale."""
import torch


def make_inputs(head_size=64, block_size=16, dtype=torch.float32, lens=(37, 150),
                num_heads=4, num_kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 2
    key_cache = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x,
                            generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, num_kv_heads, head_size, block_size,
                              generator=gen).to(dtype)
    query = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables, used = [], 0
    for n in blocks_per_seq:
        row = pool[used:used + n]
        used += n
        tables.append(row + [row[0]] * (width - n))
    return (query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), head_size ** -0.5)
