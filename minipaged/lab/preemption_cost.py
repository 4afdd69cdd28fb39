"""What a preemption costs: swapping a sequence's blocks out and back, or computing it again
(lesson 04).

Swapping moves ``2 x bytes`` over the CPU-GPU link (out, then in), one copy per block per layer
per K/V, so each block also pays a fixed per-copy latency. Recomputing runs a prefill over the
sequence's tokens: about ``2 x parameters`` floating-point operations per token. Both grow with
the sequence length; which is cheaper depends on the model's size, its KV bytes per token and the
block size.
"""
from __future__ import annotations

import math

from minipaged.lab.kv_memory import FP16_BYTES
from minipaged.model_shape import ModelShape

PCIE4_X16_BYTES_PER_S = 25e9  # what a PCIe 4.0 x16 link sustains in practice (32 GB/s peak)
COPY_LATENCY_S = 5e-6  # a small cudaMemcpyAsync: launch plus transfer set-up
GPU_FLOPS = 100e12  # an A100-class GPU in fp16 prefill, at about a third of its peak


def swap_seconds(num_tokens: int, block_size: int, shape: ModelShape,
                 bandwidth: float = PCIE4_X16_BYTES_PER_S,
                 copy_latency: float = COPY_LATENCY_S, dtype_bytes: int = FP16_BYTES) -> float:
    """Out and back in: every block of every layer's K and V is one copy each way."""
    num_blocks = math.ceil(num_tokens / block_size)
    num_copies = 2 * num_blocks * shape.num_layers * 2  # (out + in) x blocks x layers x (K, V)
    num_bytes = 2 * num_blocks * block_size * shape.kv_bytes_per_token(dtype_bytes)
    return num_bytes / bandwidth + num_copies * copy_latency


def recompute_seconds(num_tokens: int, num_params: float, flops: float = GPU_FLOPS) -> float:
    """A prefill over the sequence again: about 2 FLOPs per parameter per token."""
    return 2 * num_params * num_tokens / flops


def crossover_block_size(shape: ModelShape, num_params: float, **kwargs) -> float:
    """The block size above which swapping is cheaper than recomputing (per token; the sequence
    length cancels out once it spans whole blocks). ``inf`` if swapping never wins."""
    per_token_recompute = recompute_seconds(1, num_params, kwargs.pop("flops", GPU_FLOPS))
    bandwidth = kwargs.get("bandwidth", PCIE4_X16_BYTES_PER_S)
    latency = kwargs.get("copy_latency", COPY_LATENCY_S)
    dtype_bytes = kwargs.get("dtype_bytes", FP16_BYTES)
    per_token_bytes = 2 * shape.kv_bytes_per_token(dtype_bytes) / bandwidth
    per_block_latency = 4 * shape.num_layers * latency
    if per_token_recompute <= per_token_bytes:
        return math.inf
    return per_block_latency / (per_token_recompute - per_token_bytes)
