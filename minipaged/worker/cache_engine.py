"""The KV cache tensors: the GPU pool the model reads, and the CPU pool used as swap space.

Per layer, in the layout of docs/ARCHITECTURE.md (lesson 02 draws it, lesson 05 explains ``x``):

    key   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value [num_blocks, num_kv_heads, head_size, block_size]

On a machine without CUDA both pools live in RAM; the "GPU" pool is still the one attention
reads, so swapping and copy-on-write behave exactly as they would on a GPU.

With ``kv_cache_dtype`` "fp8" or "int8" (lesson 18, ``kernels/kv_quant.py``) the tensors hold
8-bit codes and each layer has two more, the scales of keys and of values, one float32 per token
and kv head ``[num_blocks, num_kv_heads, block_size]``; a layer's cache is then the 4-tuple
``(key, value, key_scales, value_scales)`` and every block move moves all four.

A hybrid model's KV cache groups (lesson 20, ``core/hybrid_block_manager.py``) share tensors:
``layer_places`` gives each layer its place in its group, and the layers of one place share one
tensor (a block number belongs to one group at a time). ``gpu_cache`` is still one entry per
layer; the moves go over the distinct tensors, ``gpu_tensors`` and ``cpu_tensors``.
"""
from __future__ import annotations

import torch

from minipaged.kernels import kv_quant, ops
from minipaged.model_shape import kv_bytes_per_token

KVCache = tuple[torch.Tensor, ...]  # (key, value) or, 8-bit, (key, value, key_sc, value_sc)


def cache_block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block across all layers: K and V, ``block_size`` tokens each.

    Args:
        block_size, num_layers, num_kv_heads, head_size: the cache's shape.
        dtype: the model's dtype.
        kv_cache_dtype: "auto" (the model's dtype), "fp8" or "int8" (one byte a number, plus a
            4-byte scale per token and kv head).
    """
    element, scale = kv_quant.element_and_scale_bytes(kv_cache_dtype, dtype)
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_size, element, scale)


class CacheEngine:
    """The GPU pool and the CPU swap pool of one model, every layer.

    Args:
        num_layers, num_kv_heads, head_size, block_size: the cache's shape.
        num_gpu_blocks, num_cpu_blocks: the pools' sizes.
        dtype: the model's dtype.
        device: where the GPU pool lives.
        kv_cache_dtype: "auto", "fp8" or "int8" (``kernels/kv_quant.py``).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto",
                 layer_places: tuple[int, ...] | None = None) -> None:
        self.kv_cache_dtype = kv_quant.check_kv_cache_dtype(kv_cache_dtype)
        dtype = kv_quant.storage_dtype(kv_cache_dtype, dtype)  # what the cache tensors hold
        self.num_layers = num_layers
        if layer_places is not None and len(layer_places) != num_layers:
            raise ValueError(f"layer_places names {len(layer_places)} layers, the model has "
                             f"{num_layers}")
        self.layer_places = layer_places
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self.x = ops.key_vector_size(dtype)
        if head_size % self.x:
            raise ValueError(f"head_size {head_size} must be a multiple of {self.x} for {dtype}"
                             f" (kv_cache_dtype={kv_cache_dtype!r})")
        # NOTE: the pool attention reads is zero-filled, not empty: attention multiplies masked
        # probabilities (0) by values in padding slots, and 0 * NaN from uninitialised memory
        # would poison the output. The swap pool is left empty: a CPU block is read only after
        # a swap-out wrote the whole block, and untouched host pages then take no memory.
        self.gpu_tensors = self._allocate(num_gpu_blocks, self.device, pin=False, zero=True)
        pin = self.device.type == "cuda"  # pinned host memory: asynchronous copies to the GPU
        self.cpu_tensors = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=pin,
                                          zero=False)
        self.gpu_cache = self._per_layer(self.gpu_tensors)  # what layer i reads
        self.cpu_cache = self._per_layer(self.cpu_tensors)

    def _per_layer(self, tensors: list[KVCache]) -> list[KVCache]:
        if self.layer_places is None:
            return tensors
        return [tensors[place] for place in self.layer_places]

    def key_block_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.head_size // self.x, self.block_size, self.x)

    def value_block_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.head_size, self.block_size)

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool,
                  zero: bool) -> list[KVCache]:
        make = torch.zeros if zero else torch.empty
        cache = []
        num = self.num_layers if self.layer_places is None else max(self.layer_places) + 1
        for _ in range(num):
            k = make((num_blocks, *self.key_block_shape()), dtype=self.dtype, device=device,
                     pin_memory=pin)
            v = make((num_blocks, *self.value_block_shape()), dtype=self.dtype, device=device,
                     pin_memory=pin)
            scales = ()
            if kv_quant.is_quantized(self.dtype):  # (blocks, kv_heads, block_size) each
                shape = (num_blocks, self.num_kv_heads, self.block_size)
                scales = tuple(make(shape, dtype=kv_quant.SCALE_DTYPE, device=device,
                                    pin_memory=pin) for _ in range(2))
            cache.append((k, v, *scales))
        return cache

    def swap_in(self, src_to_dst: dict[int, int]) -> None:
        """CPU blocks -> GPU blocks."""
        for cpu_layer, gpu_layer in zip(self.cpu_tensors, self.gpu_tensors):
            for cpu_t, gpu_t in zip(cpu_layer, gpu_layer):  # K, V (and their scales)
                ops.swap_blocks(cpu_t, gpu_t, src_to_dst)

    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        """GPU blocks -> CPU blocks."""
        for gpu_layer, cpu_layer in zip(self.gpu_tensors, self.cpu_tensors):
            for gpu_t, cpu_t in zip(gpu_layer, cpu_layer):  # K, V (and their scales)
                ops.swap_blocks(gpu_t, cpu_t, src_to_dst)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the CPU blocks may be reused right away

    def copy(self, src_to_dsts: dict[int, list[int]]) -> None:
        """Copy-on-write: duplicate GPU blocks, every layer (an 8-bit cache's scales too)."""
        for pair in range(0, len(self.gpu_tensors[0]), 2):  # (K, V), then (K scales, V sc.)
            ops.copy_blocks([layer[pair] for layer in self.gpu_tensors],
                            [layer[pair + 1] for layer in self.gpu_tensors], src_to_dsts)
