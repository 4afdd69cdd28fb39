"""What the two tensor-parallel back-ends share: the rank's side and the driver's (lesson 14).

Two back-ends start the ranks: ``mp_workers.py`` (processes on this machine) and
``ray_workers.py`` (Ray actors, on the nodes of a Ray cluster). Everything else is here, once:

- ``RankWorker``, the rank's side: join the ``torch.distributed`` group, build the rank's shard
  and its KV cache (a ``LocalWorker`` on the shard), then answer the driver's requests;
- ``TensorParallelDriver``, the driver's side: the ``Worker`` interface (``worker.py``) as
  requests sent to every rank. A back-end adds only how a request reaches the ranks and how
  their answers (or their deaths) come back: ``_request``, and how to stop them: the
  ``_finalizer``, whose stop function takes ``graceful`` (False: without asking the ranks).

A request is a plain tuple, the same for both back-ends:

    ("profile", max_num_batched_tokens, max_model_len, gpu_memory_utilization, block_bytes)
    ("init_cache", num_layers, kv_heads_per_rank, head_size, block_size, gpu_blocks, cpu_blocks,
     kv_cache_dtype, layer_places)
    ("step", cache_ops, (input_ids, positions, meta, sample_indices))

and every rank answers each one; only rank 0's answer to a step carries the logits.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, fields, replace

import torch

from minipaged.config import DEFAULT_TIMEOUT_S  # (the worker_timeout setting's default)
from minipaged.model_shape import ModelShape
from minipaged.models.parallel_layers import tensor_parallel_state
from minipaged.worker.worker import Worker

STARTUP_FACTOR = 5  # loading the model may take this many times the step timeout


class WorkerError(RuntimeError):
    """A tensor-parallel worker died, failed or hung; the engine's workers are stopped."""


def check_tensor_parallel(hf_config, world_size, device: torch.device,
                          gpus_on_this_machine: bool = True) -> None:
    """Refuse, with a clear ValueError, a tensor_parallel_size this model cannot split into.

    NOTE: N must divide the query heads, the kv heads and the MLP width. We refuse rather than
    replicate kv heads (as later vLLM versions do when N > kv heads): one rule, easy to draw.

    Args:
        gpus_on_this_machine: on CUDA, the ranks' GPUs are this machine's (the "mp" back-end),
            so there must be N of them; a Ray cluster counts its GPUs itself.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    shape = ModelShape.from_hf(hf_config)
    heads, kv_heads, inner = shape.num_heads, shape.num_kv_heads, shape.intermediate_size
    for what, total in (("the attention heads", heads), ("the key/value heads", kv_heads),
                        ("the MLP width", inner)):
        if total % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} does not divide {what} "
                             f"({total}) of this model; choose a tensor_parallel_size that "
                             f"divides {heads} heads, {kv_heads} kv heads and {inner} MLP "
                             f"columns")
    if (gpus_on_this_machine and device.type == "cuda"
            and world_size > torch.cuda.device_count()):
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs, this "
                         f"machine has {torch.cuda.device_count()}")


def shard_weight_bytes(hf_config, world_size: int, rank: int, dtype=torch.float32) -> int:
    """Bytes of rank ``rank``'s weights, from a shard built on the meta device (no memory)."""
    from minipaged.models.registry import get_model_class

    with tensor_parallel_state(rank, world_size), torch.device("meta"):
        model = get_model_class(hf_config)(hf_config)
    element = torch.tensor([], dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * element


@dataclass
class WorkerSpec:
    """What a rank needs to build its shard (sent to the rank's process or actor)."""

    hf_config: object
    source: str | None
    load_format: str
    dtype: torch.dtype
    device: str
    timeout: float
    num_threads: int


def meta_to(meta, device):
    """The step's ``InputMetadata`` with its tensors on ``device``, and its other KV cache
    groups' (``group_metas``, a hybrid model's: lesson 20) likewise."""
    moved = {f.name: getattr(meta, f.name).to(device) for f in fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    if meta.group_metas is not None:
        moved["group_metas"] = [meta_to(m, device) for m in meta.group_metas]
    return replace(meta, **moved)


# -- the rank's side ---------------------------------------------------------------------------
class RankWorker:
    """One rank: its process group, its shard, its KV cache; answers the driver's requests.

    Args:
        rank, world_size: this rank and N.
        init_method: where the ranks meet (``file://...`` on one machine, ``tcp://ip:port``).
        spec: the model to build and the step timeout (also the collectives' timeout).
        gpu_index: the CUDA device this rank uses (rank r of the "mp" back-end uses GPU r; a
            Ray actor sees only the GPU Ray gave it, as device 0).
    """

    def __init__(self, rank: int, world_size: int, init_method: str, spec: WorkerSpec,
                 gpu_index: int | None = None) -> None:
        import datetime

        import torch.distributed as dist

        from minipaged.models.parallel_layers import set_tensor_parallel_state
        from minipaged.worker.worker import LocalWorker

        self.rank = rank
        self.device = device = torch.device(spec.device)
        if device.type == "cuda":
            self.device = device = torch.device("cuda", rank if gpu_index is None else gpu_index)
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.num_threads)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=spec.timeout))
        set_tensor_parallel_state(rank, world_size)
        # This rank's shard, its cache and its runner: one process's worker, as with N = 1.
        self.worker = LocalWorker(spec.hf_config, spec.source, spec.load_format, spec.dtype,
                                  device)

    def weight_bytes(self) -> int:
        return self.worker.memory_per_rank()[0]["weights"]

    def handle(self, request: tuple):
        """Carry out one request of the driver; returns this rank's answer."""
        from minipaged.worker.model_runner import PreparedInputs

        kind = request[0]
        if kind == "profile":
            return self.worker.profile_num_gpu_blocks(*request[1:])
        if kind == "init_cache":
            *sizes, kv_cache_dtype, layer_places, max_model_len = request[1:]
            self.worker.init_cache(*sizes, kv_cache_dtype, max_model_len=max_model_len,
                                   layer_places=layer_places)
            return self.worker.memory_per_rank()[0]["kv_cache"]
        if kind == "step":
            _, cache_ops, (input_ids, positions, meta, sample_indices) = request
            for op, arg in cache_ops:  # swap_out, swap_in, copy: in the driver's order
                getattr(self.worker, op)(arg)
            device = self.device
            inputs = PreparedInputs(input_ids.to(device), positions.to(device),
                                    meta_to(meta, device), [], sample_indices.to(device), [])
            logits = self.worker.execute_model(inputs)  # (R, vocab), all ranks
            return logits.cpu() if self.rank == 0 else None
        raise ValueError(f"unknown request {kind!r}")

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# -- the driver's side -------------------------------------------------------------------------
class TensorParallelDriver(Worker):
    """The ``Worker`` interface over N ranks, whatever starts them.

    The driver's own tensors (inputs, logits, sampling) stay on the CPU (``device``); the
    caches live in the ranks. A back-end calls ``_init_driver``, sets ``weight_bytes`` and
    ``_finalizer`` (a ``weakref.finalize`` of a stop function with a ``graceful`` keyword), and
    implements ``_request``.
    """

    device = torch.device("cpu")
    world_size: int
    worker_device: torch.device
    timeout: float

    def _init_driver(self, world_size: int, device: torch.device, timeout) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"worker_timeout must be a number of seconds > 0, got {timeout!r}")
        self.world_size = world_size
        self.worker_device = device
        self.timeout = float(timeout)
        self._error: str | None = None
        self._cache_ops: list[tuple[str, dict]] = []
        self.weight_bytes: list[int] = [0] * world_size
        self.kv_cache_bytes: list[int] = [0] * world_size

    @abstractmethod
    def _request(self, request: tuple, what: str) -> list:
        """Send ``request`` to every rank; their answers in rank order. A rank that dies,
        raises or is late: ``_fail`` (which raises WorkerError)."""

    def _stop_now(self, reason: str) -> None:
        """Stop the ranks without asking them (they may be dead, hung or mid-collective), and
        remember ``reason`` in ``_error``."""
        self._error = reason
        stopping = self._finalizer.detach()  # (self, stop, args, kwargs), or None if done
        if stopping is not None:
            _, stop, args, kwargs = stopping
            stop(*args, **{**kwargs, "graceful": False})

    def _call(self, request: tuple, what: str) -> list:
        if self._error is not None:
            raise WorkerError(f"the tensor-parallel workers were stopped after an error: "
                              f"{self._error}")
        if not self._finalizer.alive:
            raise WorkerError("the tensor-parallel workers were shut down")
        try:
            return self._request(request, what)
        except WorkerError:
            raise
        except BaseException:  # Ctrl-C mid-step: the ranks' next answer would be stale
            self._stop_now(f"interrupted during {what}")
            raise

    def _fail(self, message: str) -> None:
        self._stop_now(message)
        raise WorkerError(message)

    # -- what the engine calls -------------------------------------------------------------------
    def profile_num_gpu_blocks(self, max_num_batched_tokens: int, max_model_len: int,
                               gpu_memory_utilization: float, block_bytes: int) -> int | None:
        """CUDA: each rank profiles its own GPU; the pool is what the tightest rank allows."""
        if self.worker_device.type != "cuda":
            return None
        return min(self._call(("profile", max_num_batched_tokens, max_model_len,
                               gpu_memory_utilization, block_bytes), "profiling"))

    def init_cache(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                   num_gpu_blocks: int, num_cpu_blocks: int, kv_cache_dtype: str = "auto",
                   use_cuda_graphs: bool = False, max_num_seqs: int = 256,
                   max_model_len: int | None = None,
                   layer_places: tuple[int, ...] | None = None) -> None:
        """Allocate each rank's cache: the same blocks, ``num_kv_heads / N`` heads each; with
        ``layer_places`` (a hybrid model's KV cache groups, lesson 20) every rank lays its
        layers out by group alike, so each group's block tables (the step's ``group_metas``)
        serve all ranks.

        NOTE: ``use_cuda_graphs`` is ignored: each step's inputs come from another process, so
        the ranks run their decode steps eagerly."""
        per_rank = num_kv_heads // self.world_size
        self.kv_cache_bytes = self._call(("init_cache", num_layers, per_rank, head_size,
                                          block_size, num_gpu_blocks, num_cpu_blocks,
                                          kv_cache_dtype, layer_places, max_model_len), "init")

    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        self._cache_ops.append(("swap_out", dict(src_to_dst)))

    def swap_in(self, src_to_dst: dict[int, int]) -> None:
        self._cache_ops.append(("swap_in", dict(src_to_dst)))

    def copy(self, src_to_dsts: dict[int, list[int]]) -> None:
        self._cache_ops.append(("copy", {k: list(v) for k, v in src_to_dsts.items()}))

    def execute_model(self, inputs) -> torch.Tensor:
        """Logits (R, vocab) of one step; the cache operations queued since the last step go
        first."""
        cache_ops, self._cache_ops = self._cache_ops, []
        small = (inputs.input_ids.cpu(), inputs.positions.cpu(), meta_to(inputs.meta, "cpu"),
                 inputs.sample_indices.cpu())
        return self._call(("step", cache_ops, small), "a step")[0]

    def memory_per_rank(self) -> list[dict[str, int]]:
        return [{"weights": w, "kv_cache": kv}
                for w, kv in zip(self.weight_bytes, self.kv_cache_bytes)]

    def shutdown(self) -> None:
        self._finalizer()
