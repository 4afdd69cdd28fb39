"""The KV pools, sized and allocated once when the engine starts (lessons 01 and 08).

Three steps, in this order: the bytes of one block (all layers, K and V, per rank); how many
blocks the GPU and CPU pools get (``config.kv_pool_blocks``: profiled on CUDA, a budget in bytes
on the CPU, or given); the longest request those pools and the step's budget can run
(``config.fit_max_model_len``). Then the worker allocates the pools' tensors, and the
scheduler's block manager their bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.config import EngineConfig, fit_max_model_len, kv_pool_blocks
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.core.sliding_window import SlidingWindowBlockManager
from minipaged.model_shape import ModelShape
from minipaged.worker.cache_engine import cache_block_bytes
from minipaged.worker.gpu_memory import naming_memory_holders
from minipaged.worker.worker import Worker


@dataclass(frozen=True)
class CacheSetup:
    """What sizing the pools decided, and the scheduler that hands out their blocks."""

    scheduler: Scheduler  # its config: max_model_len as fitted, the step's token budget
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int  # one block, all layers, K and V (per rank under tensor parallel)
    max_model_len_reason: str  # why max_model_len is what it is, for error messages


def init_kv_cache(cfg: EngineConfig, worker: Worker, shape: ModelShape,
                  dtype: torch.dtype) -> CacheSetup:
    """Size the pools, fit ``max_model_len`` to them, have ``worker`` allocate them, and make
    the scheduler (and its block manager) for them.

    Args:
        cfg: the engine's settings.
        worker: the worker that holds the model (it profiles the GPU and holds the pools).
        shape: the model's shape (``ModelShape.from_hf``).
        dtype: the cache's dtype.
    """
    model_max_len = shape.max_positions
    max_len = min(cfg.max_model_len or model_max_len, model_max_len)  # before fitting
    budget = cfg.batch_budget(max_len)
    block_bytes = cache_block_bytes(  # per rank: each holds its share of the kv heads
        cfg.block_size, shape.num_layers, shape.num_kv_heads // cfg.tensor_parallel_size,
        shape.head_size, dtype, cfg.kv_cache_dtype)
    profiled = (None if cfg.num_gpu_blocks is not None else worker.profile_num_gpu_blocks(
        budget, max_len, cfg.gpu_memory_utilization, block_bytes))
    with naming_memory_holders(worker):  # on a GPU, a refusal says who holds memory
        num_gpu_blocks, num_cpu_blocks = kv_pool_blocks(cfg, block_bytes, max_len, profiled)
        max_len, reason = fit_max_model_len(cfg, model_max_len, num_gpu_blocks, budget)
    window = frees_out_of_window(cfg, shape)
    # NOTE: with a window, one block past the pool: the sink (core/sliding_window.py)
    worker.init_cache(shape.num_layers, shape.num_kv_heads, shape.head_size, cfg.block_size,
                      num_gpu_blocks + (window is not None), num_cpu_blocks, cfg.kv_cache_dtype,
                      use_cuda_graphs=not cfg.enforce_eager, max_num_seqs=cfg.max_num_seqs,
                      max_model_len=max_len)
    scheduler_config = SchedulerConfig(cfg.max_num_seqs, budget, max_len, cfg.preemption_mode,
                                       cfg.enable_chunked_prefill)
    if window is None:
        scheduler = Scheduler.with_pools(scheduler_config, cfg.block_size, num_gpu_blocks,
                                         num_cpu_blocks, cfg.watermark, cfg.enable_prefix_caching)
    else:
        scheduler = Scheduler(scheduler_config, SlidingWindowBlockManager(
            cfg.block_size, num_gpu_blocks, num_cpu_blocks, cfg.watermark,
            cfg.enable_prefix_caching, window=window, sink_block=num_gpu_blocks))
    return CacheSetup(scheduler, num_gpu_blocks, num_cpu_blocks, block_bytes, reason)


def frees_out_of_window(cfg: EngineConfig, shape: ModelShape) -> int | None:
    """The window whose out-of-window blocks the block manager may free, or None to keep every
    block: only when every layer slides by it (a full layer reads the whole context), and
    without a draft model (whose layers may not slide: ``core/sliding_window.py``).

    Args:
        cfg: the engine's settings.
        shape: the model's shape (its ``windows``).
    """
    spec = cfg.speculative_config
    if spec is not None and spec.method == "draft":
        return None
    return shape.uniform_window
