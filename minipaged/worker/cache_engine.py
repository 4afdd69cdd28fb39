"""The KV cache tensors: the GPU pool the model reads, and the CPU pool used as swap space.

Per layer, in the layout of docs/ARCHITECTURE.md (lesson 02 draws it, lesson 05 explains ``x``):

    key   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value [num_blocks, num_kv_heads, head_size, block_size]

On a machine without CUDA both pools live in RAM; the "GPU" pool is still the one attention
reads, so swapping and copy-on-write behave exactly as they would on a GPU.
"""
from __future__ import annotations

import torch

from minipaged.kernels import ops

KVCache = tuple[torch.Tensor, torch.Tensor]


class CacheEngine:
    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self.x = ops.key_vector_size(dtype)
        if head_size % self.x:
            raise ValueError(f"head_size {head_size} must be a multiple of {self.x} for {dtype}")
        # NOTE: the pool attention reads is zero-filled, not empty: attention multiplies masked
        # probabilities (0) by values in padding slots, and 0 * NaN from uninitialised memory
        # would poison the output. The swap pool is left empty: a CPU block is read only after
        # a swap-out wrote the whole block, and untouched host pages then take no memory.
        self.gpu_cache = self._allocate(num_gpu_blocks, self.device, pin=False, zero=True)
        pin = self.device.type == "cuda"  # pinned host memory: asynchronous copies to the GPU
        self.cpu_cache = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=pin, zero=False)

    def key_block_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.head_size // self.x, self.block_size, self.x)

    def value_block_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.head_size, self.block_size)

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool,
                  zero: bool) -> list[KVCache]:
        make = torch.zeros if zero else torch.empty
        cache = []
        for _ in range(self.num_layers):
            k = make((num_blocks, *self.key_block_shape()), dtype=self.dtype, device=device,
                     pin_memory=pin)
            v = make((num_blocks, *self.value_block_shape()), dtype=self.dtype, device=device,
                     pin_memory=pin)
            cache.append((k, v))
        return cache

    def swap_in(self, src_to_dst: dict[int, int]) -> None:
        """CPU blocks -> GPU blocks."""
        for (cpu_k, cpu_v), (gpu_k, gpu_v) in zip(self.cpu_cache, self.gpu_cache):
            ops.swap_blocks(cpu_k, gpu_k, src_to_dst)
            ops.swap_blocks(cpu_v, gpu_v, src_to_dst)

    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        """GPU blocks -> CPU blocks."""
        for (gpu_k, gpu_v), (cpu_k, cpu_v) in zip(self.gpu_cache, self.cpu_cache):
            ops.swap_blocks(gpu_k, cpu_k, src_to_dst)
            ops.swap_blocks(gpu_v, cpu_v, src_to_dst)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the CPU blocks may be reused right away

    def copy(self, src_to_dsts: dict[int, list[int]]) -> None:
        """Copy-on-write: duplicate GPU blocks, every layer."""
        ops.copy_blocks([k for k, _ in self.gpu_cache], [v for _, v in self.gpu_cache],
                        src_to_dsts)
