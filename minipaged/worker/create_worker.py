"""Which ``Worker`` an engine gets: one process, or N tensor-parallel ranks (lessons 08, 14)."""
from __future__ import annotations

import torch

from minipaged.config import DEFAULT_TIMEOUT_S
from minipaged.kernels.build import start_background_build
from minipaged.worker.mp_workers import TensorParallelWorkers
from minipaged.worker.worker import LocalWorker, Worker


def start_building_ops(device: torch.device) -> None:
    """Start compiling the attention op of ``device`` in the background now, so that the build
    overlaps finding (and on a first run, converting) the checkpoint and loading its weights."""
    start_background_build(device)


def create_worker(hf_config, source: str | None, load_format: str, dtype: torch.dtype,
                  device: torch.device, tensor_parallel_size: int = 1,
                  distributed_executor_backend: str | None = None,
                  worker_timeout: float = DEFAULT_TIMEOUT_S,
                  cpu_threads: int | None = None) -> Worker:
    """The ``Worker`` the settings ask for: one process, or N ranks (lesson 14).

    Args:
        hf_config, source, load_format, dtype, device: the model, as for ``LocalWorker``.
        tensor_parallel_size: ranks holding a shard each (1: this process holds the model).
        distributed_executor_backend: "mp" (processes on this machine, the default) or "ray".
        worker_timeout: seconds a rank may take to answer.
        cpu_threads: torch's threads for a model on the CPU (None: chosen per step); one
            process only (each tensor-parallel rank sets its own share of the cores).
    """
    backend = distributed_executor_backend or "mp"
    if tensor_parallel_size == 1 and backend == "mp":
        return LocalWorker(hf_config, source, load_format, dtype, device, cpu_threads)
    workers_class = TensorParallelWorkers
    if backend == "ray":  # NOTE: imported only when asked for: it imports Ray (seconds)
        from minipaged.worker.ray_workers import RayTensorParallelWorkers as workers_class
    return workers_class(tensor_parallel_size, hf_config, source, load_format, dtype, device,
                         worker_timeout)
