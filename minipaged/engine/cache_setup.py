"""The KV pools, sized and allocated once when the engine starts (lessons 01 and 08).

Three steps, in this order: the bytes of one block (all layers, K and V, per rank); how many
blocks the GPU and CPU pools get (``config.kv_pool_blocks``: profiled on CUDA, a budget in bytes
on the CPU, or given); the longest request those pools and the step's budget can run
(``config.fit_max_model_len``). Then the worker allocates the pools' tensors, and the
scheduler's block manager their bookkeeping.

A hybrid model (sliding and full layers, Gemma 3: lesson 20) gets KV cache groups
(``core/hybrid_block_manager.py``): the same memory, counted as above in blocks of every layer,
is cut into blocks of one group's layers (``num_layers / group size`` times as many), and each
group of layers has its own block table. ``hybrid_groups`` says when it keeps every block in
one table instead.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minipaged.config import EngineConfig, fit_max_model_len, kv_pool_blocks
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.core.hybrid_block_manager import HybridBlockManager
from minipaged.core.sliding_window import SlidingWindowBlockManager
from minipaged.model_shape import KVGroup, ModelShape, kv_groups, layer_kv_groups
from minipaged.worker.cache_engine import cache_block_bytes
from minipaged.worker.gpu_memory import naming_memory_holders
from minipaged.worker.worker import Worker

logger = logging.getLogger("minipaged")


@dataclass(frozen=True)
class CacheSetup:
    """What sizing the pools decided, and the scheduler that hands out their blocks."""

    scheduler: Scheduler  # its config: max_model_len as fitted, the step's token budget
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int  # one block, all layers, K and V (per rank under tensor parallel)
    max_model_len_reason: str  # why max_model_len is what it is, for error messages
    # a hybrid model's KV cache groups (lesson 20): a request's block of tokens takes one
    # block of each, so the request checks count the pool in num_gpu_blocks // num_kv_groups
    num_kv_groups: int = 1


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
        groups = hybrid_groups(cfg, shape, worker)
        if groups is not None:
            return _init_hybrid(cfg, worker, shape, dtype, groups, num_gpu_blocks,
                                num_cpu_blocks, model_max_len, budget)
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


# NOTE: KV cache groups have not run on a GPU yet; tests/gpu/test_hybrid_kv_gpu.py (make
# gpu-check) turns this on to try them there, and a GPU session sets it by what that shows.
GROUPS_ON_CUDA = False


def hybrid_groups(cfg: EngineConfig, shape: ModelShape, worker: Worker
                  ) -> tuple[KVGroup, ...] | None:
    """The KV cache groups of a hybrid model (sliding and full layers), or None to keep every
    block in one table: for a model of one kind of layer, and (logged once, with the reason)
    where the groups are not built yet: with ``kv_cache_groups=False``, or a model on CUDA.
    Under tensor parallel each rank lays out its layers by group (``layer_places``) and reads
    the step's per-group tables (``group_metas``); multi-step decode and speculative decoding
    reserve their lookahead slots in every group and roll them back in every group, and
    multi-step lays out each group's later slots (``engine/multi_step.py``). A draft model
    reads its own KV through the full group's table, which keeps every block.

    NOTE: the draft's cache has a block for every block number of the pool (the full group's
    blocks may be any of them), so with groups it holds ``num_layers / group size`` times
    the blocks it holds without them; its memory is outside the target's pool either way.

    Args:
        cfg: the engine's settings.
        shape: the model's shape (its ``windows``).
        worker: the worker (on CUDA or not).
    """
    groups = kv_groups(shape.windows)
    if len(groups) < 2 or groups[0].window is not None:
        return None  # one kind of layer (or every layer sliding: core/sliding_window.py)
    why_not = [reason for reason, off in (
        ("kv_cache_groups=False", not cfg.kv_cache_groups),
        ("CUDA (not measured there yet)", getattr(worker, "device", None) is not None
         and worker.device.type == "cuda" and not GROUPS_ON_CUDA),
    ) if off]
    if why_not:
        logger.info("KV cache groups off (every layer keeps every block): not built yet with "
                    "%s", ", ".join(why_not))
        return None
    return groups


def _init_hybrid(cfg: EngineConfig, worker: Worker, shape: ModelShape, dtype: torch.dtype,
                 groups: tuple[KVGroup, ...], num_gpu_blocks: int, num_cpu_blocks: int,
                 model_max_len: int, budget: int) -> CacheSetup:
    """``init_kv_cache`` for KV cache groups: the pools' memory (``num_gpu_blocks`` blocks of
    every layer) cut into blocks of one group's layers, plus the sink."""
    size = max(len(g.layers) for g in groups)  # layers of a group: the tensors of the cache
    num_gpu_blocks = num_gpu_blocks * shape.num_layers // size
    num_cpu_blocks = num_cpu_blocks * shape.num_layers // size
    block_bytes = cache_block_bytes(  # per rank, as in init_kv_cache
        cfg.block_size, size, shape.num_kv_heads // cfg.tensor_parallel_size, shape.head_size,
        dtype, cfg.kv_cache_dtype)
    # every block of tokens takes one block in each group: the checks count whole ones
    max_len, reason = fit_max_model_len(cfg, model_max_len, num_gpu_blocks // len(groups),
                                        budget)
    places = tuple(place for _, place in layer_kv_groups(shape.windows))
    worker.init_cache(shape.num_layers, shape.num_kv_heads, shape.head_size, cfg.block_size,
                      num_gpu_blocks + 1, num_cpu_blocks, cfg.kv_cache_dtype,
                      use_cuda_graphs=False, max_num_seqs=cfg.max_num_seqs,
                      max_model_len=max_len, layer_places=places)
    scheduler_config = SchedulerConfig(cfg.max_num_seqs, budget, max_len, cfg.preemption_mode,
                                       cfg.enable_chunked_prefill)
    manager = HybridBlockManager(cfg.block_size, num_gpu_blocks, num_cpu_blocks, cfg.watermark,
                                 cfg.enable_prefix_caching,
                                 windows=tuple(g.window for g in groups),
                                 sink_block=num_gpu_blocks)
    return CacheSetup(Scheduler(scheduler_config, manager), num_gpu_blocks, num_cpu_blocks,
                      block_bytes, reason, len(groups))
