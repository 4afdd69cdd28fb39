"""What runs the model for the engine: one ``Worker`` interface, three implementations (lesson 08).

The engine (``engine/llm_engine.py``) keeps the bookkeeping: the scheduler (which owns the block
manager) and the sampler.
Everything that holds tensors of the model or of the KV cache sits behind a ``Worker``:

- ``LocalWorker``: the model, its ``CacheEngine`` and a ``ModelRunner`` in this process;
- ``TensorParallelWorkers`` (``worker/mp_workers.py``, lesson 14): N processes on this machine,
  one shard each, every one of them running a ``RankWorker`` (``worker/tensor_parallel.py``);
- ``RayTensorParallelWorkers`` (``worker/ray_workers.py``): the same ``RankWorker`` in N Ray
  actors, placed on the nodes of a Ray cluster.

The engine calls only the methods below, in this order: ``profile_num_gpu_blocks`` (may be
skipped), ``init_cache`` once, then per step ``cache_swap`` (the cache moves) and
``execute_model``, and ``shutdown`` at the end (``memory_report`` only to explain a pool that
does not fit). A new back-end implements these and nothing else. The engine hands the worker
plain data only: block numbers in the cache moves, and the batch that ``prepare_inputs`` built
from the scheduler's record (``step_record.py``).
"""
from __future__ import annotations

import logging
import warnings
import weakref
from abc import ABC, abstractmethod

import torch

from minipaged.kernels.build import start_background_build
from minipaged.models.rotary import fit_positions
from minipaged.worker import gpu_memory
from minipaged.worker.cache_engine import CacheEngine, cache_block_bytes
from minipaged.worker.cpu_threads import ThreadChooser
from minipaged.worker.model_loader import build_model, profile_num_gpu_blocks
from minipaged.worker.model_runner import ModelRunner, PreparedInputs

logger = logging.getLogger("minipaged")


class Worker(ABC):
    """The engine's handle on whatever holds the model and the KV cache.

    ``device`` is where the engine builds each step's inputs (``prepare_inputs``) and receives
    the logits: the model's device for a ``LocalWorker``, the CPU for workers in other
    processes.
    """

    device: torch.device

    @abstractmethod
    def profile_num_gpu_blocks(self, max_num_batched_tokens: int, max_model_len: int,
                               gpu_memory_utilization: float, block_bytes: int) -> int | None:
        """How many KV blocks fit in the GPU memory a profiled forward pass leaves.

        Args:
            max_num_batched_tokens: tokens of the largest step the scheduler allows.
            max_model_len: the longest prompt of that step.
            gpu_memory_utilization: the fraction of GPU memory the engine may use.
            block_bytes: bytes of one KV block (per rank).

        Returns:
            The number of blocks, or None when the model runs on the CPU (nothing to profile).
        """

    @abstractmethod
    def init_cache(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                   num_gpu_blocks: int, num_cpu_blocks: int, kv_cache_dtype: str = "auto",
                   use_cuda_graphs: bool = False, max_num_seqs: int = 256,
                   max_model_len: int | None = None, **hybrid) -> None:
        """Allocate the KV pools (once, before the first step).

        Args:
            num_layers, num_kv_heads, head_size: the model's shape (all kv heads: a
                tensor-parallel worker keeps its share).
            block_size: tokens per block.
            num_gpu_blocks, num_cpu_blocks: the pools' sizes, the same on every rank.
            kv_cache_dtype: "auto", "fp8" or "int8" (an 8-bit cache, lesson 18).
            use_cuda_graphs: serve decode steps from CUDA graphs where the worker can (lesson
                15); a worker that cannot (not on CUDA, several processes) runs them eagerly.
            max_num_seqs, max_model_len: size the graphs' static buffers (2048 positions
                where no max_model_len is given); max_model_len also cuts the model's rotary
                tables to the positions the engine uses (``models/rotary.fit_positions``).
            hybrid: ``layer_places`` for a hybrid model's KV cache groups (lesson 20,
                ``worker/cache_engine.py``); under tensor parallel each rank gets the same
                places, and each step's ``group_metas`` (``worker/tensor_parallel.py``).
        """

    @abstractmethod
    def swap_in(self, src_to_dst: dict[int, int]) -> None:
        """CPU blocks -> GPU blocks, before the next ``execute_model`` reads the cache."""

    @abstractmethod
    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        """GPU blocks -> CPU blocks, before the next ``execute_model`` reads the cache."""

    @abstractmethod
    def copy(self, src_to_dsts: dict[int, list[int]]) -> None:
        """Copy-on-write of GPU blocks, before the next ``execute_model`` reads the cache."""

    def cache_swap(self, blocks_to_swap_in: dict[int, int], blocks_to_swap_out: dict[int, int],
                   blocks_to_copy: dict[int, list[int]]) -> None:
        """The step's cache moves, before ``execute_model`` reads the cache (swap-outs first:
        a block swapped out may be the destination of a swap-in of the same step).

        Args:
            blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy: ``SchedulerOutputs``'.
        """
        if blocks_to_swap_out:
            self.swap_out(blocks_to_swap_out)
        if blocks_to_swap_in:
            self.swap_in(blocks_to_swap_in)
        if blocks_to_copy:
            self.copy(blocks_to_copy)

    @abstractmethod
    def execute_model(self, inputs: PreparedInputs) -> torch.Tensor:
        """Run the model on one step's flat batch; logits (R, vocab) in float32 on ``device``.

        Args:
            inputs: the step's batch, from ``prepare_inputs`` (its tensors on ``device``).
        """

    @abstractmethod
    def memory_per_rank(self) -> list[dict[str, int]]:
        """Bytes of weights and of the GPU KV pool, measured on the tensors, one dict a rank."""

    def shutdown(self) -> None:
        """Release what the worker holds (processes, memory); calling it twice does nothing."""

    def memory_report(self) -> str:
        """Who holds the GPU memory this worker could not get ("" where nobody profiles)."""
        return ""


class LocalWorker(Worker):
    """The model, its KV cache and its runner, in this process.

    On CUDA it reads what this process may still take before the weights load (the KV pool is
    sized from that, ``gpu_memory.py``), and it gives its memory back at ``shutdown()`` or when
    it is collected (``del llm``).

    Args:
        hf_config, source, load_format: the model to build (``model_loader.build_model``).
        dtype: the weights' and the cache's dtype.
        device: where the model and the GPU pool live.
        cpu_threads: on the CPU, torch's threads for each step: None chooses per step from
            the step's size and the machine's load (``worker/cpu_threads.py``).
    """

    _HOLDS_TENSORS = ("model", "model_runner", "cache_engine")

    def __init__(self, hf_config, source: str | None, load_format: str, dtype: torch.dtype,
                 device: torch.device, cpu_threads: int | None = None) -> None:
        self.device = device
        self.dtype = dtype
        on_gpu = self._on_gpu()
        self._memory_at_start = gpu_memory.DeviceMemory.read(device) if on_gpu else None
        # NOTE: before the weights load: the attention op for this device compiles in the
        # background meanwhile, so the first request does not wait for the compiler.
        start_background_build(device)
        self.model = None
        try:
            self.model = build_model(hf_config, source, load_format, dtype, device)
        except torch.OutOfMemoryError as e:  # say who holds the memory the weights did not get
            raise torch.OutOfMemoryError(f"{e}\n{gpu_memory.holders_report(self)}") from None
        self.model_runner = ModelRunner(self.model)
        self.cache_engine: CacheEngine | None = None  # init_cache creates it
        # NOTE: on the CPU only: a GPU step's threads just launch kernels
        self.threads = (None if on_gpu else
                        ThreadChooser(cpu_threads, hf_config.hidden_size))
        # NOTE: a finalizer, not __del__: it runs once, at shutdown() or at collection, and
        # holds the attribute dict rather than the worker (gpu_memory.release says why).
        self._finalizer = weakref.finalize(self, gpu_memory.release, self.__dict__,
                                           self._HOLDS_TENSORS, on_gpu)
        self._finalizer.atexit = False  # at exit the process gives everything back anyway
        if on_gpu:
            gpu_memory.register(self)

    def _on_gpu(self) -> bool:
        """Whether the model and the pool live on a CUDA device.

        NOTE: the one place that decides it, so that the tests can run the GPU's pool sizing
        on the CPU with a fake device (tests/worker/test_gpu_pool_fake_device.py)."""
        return self.device.type == "cuda"

    def profile_num_gpu_blocks(self, max_num_batched_tokens: int, max_model_len: int,
                               gpu_memory_utilization: float, block_bytes: int) -> int | None:
        if not self._on_gpu():
            return None
        others = gpu_memory.other_engines(self)
        if others:
            logger.warning(
                "%d other engine(s) alive in this process hold %s of %s; this engine's KV pool "
                "gets gpu_memory_utilization (%s) of what they leave. Shut them down "
                "(llm.shutdown(), or del and gc.collect()) to give their memory back.",
                len(others), gpu_memory.gib(sum(m["weights"] + m["kv_cache"] for m in others)),
                self.device, gpu_memory_utilization)
        return profile_num_gpu_blocks(self.model, self.device, max_num_batched_tokens,
                                      max_model_len, gpu_memory_utilization, block_bytes,
                                      self._memory_at_start)

    def init_cache(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                   num_gpu_blocks: int, num_cpu_blocks: int, kv_cache_dtype: str = "auto",
                   use_cuda_graphs: bool = False, max_num_seqs: int = 256,
                   max_model_len: int | None = None,
                   layer_places: tuple[int, ...] | None = None) -> None:
        if self._on_gpu():  # a clear refusal rather than an out-of-memory error half-way
            num_tensors = num_layers if layer_places is None else max(layer_places) + 1
            need = num_gpu_blocks * cache_block_bytes(block_size, num_tensors, num_kv_heads,
                                                      head_size, self.dtype, kv_cache_dtype)
            if need > gpu_memory.DeviceMemory.read(self.device).available:
                raise ValueError(f"num_gpu_blocks={num_gpu_blocks}: the KV pool needs "
                                 f"{gpu_memory.gib(need)} and this process cannot get it. "
                                 + gpu_memory.holders_report(self, need))
        self.cache_engine = CacheEngine(num_layers, num_kv_heads, head_size, block_size,
                                        num_gpu_blocks, num_cpu_blocks, self.dtype, self.device,
                                        kv_cache_dtype, layer_places)
        if layer_places is not None:  # the layers read each group's tables (models/llama.py)
            for module in self.model.modules():
                if hasattr(module, "grouped_cache"):
                    module.grouped_cache = True
        if max_model_len is not None:  # the rotary tables: the positions the engine uses
            fit_positions(self.model, max_model_len)
        if use_cuda_graphs and self.device.type == "cuda":  # (lesson 15)
            self.enable_cuda_graphs(max_num_seqs, max_model_len or 2048, block_size)

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, block_size: int,
                           capture: bool | None = None) -> None:
        """Serve decode steps from CUDA graphs (``worker/cuda_graphs.py``), after ``init_cache``.

        Args:
            max_num_seqs, max_model_len, block_size: size the graphs' static buffers.
            capture: record the graphs now (default on CUDA); False runs decode steps eagerly
                on the same static buffers (how the CPU tests check the padding).
        """
        from minipaged.worker.cuda_graphs import GraphRunner

        runner = GraphRunner(self.model, self.cache_engine.gpu_cache, max_num_seqs,
                             max_model_len, block_size, capture)
        try:
            runner.capture_all()
        except Exception as exc:  # noqa: BLE001 - the engine must run without graphs too
            # NOTE: a model whose step cannot be captured (a host synchronisation inside it,
            # say) still runs, eagerly, rather than failing at start-up.
            warnings.warn(f"CUDA graph capture failed, decode steps run eagerly: {exc!r}")
            return
        self.model_runner.graph_runner = runner

    def swap_in(self, src_to_dst: dict[int, int]) -> None:
        self.cache_engine.swap_in(src_to_dst)

    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        self.cache_engine.swap_out(src_to_dst)

    def copy(self, src_to_dsts: dict[int, list[int]]) -> None:
        self.cache_engine.copy(src_to_dsts)

    def execute_model(self, inputs: PreparedInputs) -> torch.Tensor:
        if self.threads is not None:
            self.threads.before_step(inputs.input_ids.numel())
        return self.model_runner.execute_model(inputs, self.cache_engine.gpu_cache)

    def shutdown(self) -> None:
        """Drop the model, the KV and swap pools and the CUDA graphs; on CUDA hand torch's
        cached blocks back to the device. Calling it again does nothing."""
        self._finalizer()

    def memory_report(self) -> str:
        return gpu_memory.holders_report(self) if self._on_gpu() else ""

    def memory_per_rank(self) -> list[dict[str, int]]:
        if self.model is None:  # shut down
            return [{"weights": 0, "kv_cache": 0}]
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv_cache = (0 if self.cache_engine is None else
                    sum(t.numel() * t.element_size() for kv in self.cache_engine.gpu_tensors
                        for t in kv))
        return [{"weights": weights, "kv_cache": kv_cache}]
