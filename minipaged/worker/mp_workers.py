"""Tensor parallelism: N worker processes, one shard of the model each (lesson 14).

The driver (the ``LLMEngine`` in the user's process) keeps the scheduler, the block manager and
the sampler, and holds no model. Worker ``r`` of N joins a ``torch.distributed`` group (gloo on
the CPU, NCCL on CUDA, device ``cuda:r``), builds its shard of the model
(``models/parallel_layers.py``) and a KV cache for its own kv heads only (``num_kv_heads / N``
per layer; the block numbers are the same on every rank, so one block table serves all).

One step:

    driver -> every worker : the step's cache operations (swap out, swap in, copy, in order) and
                             the prepared inputs (token ids, positions, slot mapping, block
                             tables: small tensors)
    every worker           : applies the operations to its blocks and runs its shard; the layers
                             all-reduce and all-gather among the workers
    worker 0 -> driver     : the logits, gathered over the vocabulary, once; the others "done"

NOTE: like vLLM v0.1 (whose driver steered Ray workers), the driver is not a rank: the user's
process never joins a process group, so several engines can live in one process.

Failures: the driver waits for the answers with a timeout while watching the processes. A
worker that dies, raises, or does not answer in time stops all workers and raises
``WorkerError``; the engine then refuses further steps. Shutdown (``LLMEngine.shutdown``, ``del``,
interpreter exit) stops every worker process; a worker whose driver disappears exits by itself.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, fields, replace

import torch

from minipaged.models.parallel_layers import tensor_parallel_state
from minipaged.worker.worker import Worker

DEFAULT_TIMEOUT_S = 120.0  # one step; loading the model may take STARTUP_FACTOR times longer
STARTUP_FACTOR = 5


class WorkerError(RuntimeError):
    """A tensor-parallel worker died, failed or hung; the engine's workers are stopped."""


def check_tensor_parallel(hf_config, world_size, device: torch.device) -> None:
    """Refuse, with a clear ValueError, a tensor_parallel_size this model cannot split into.

    NOTE: N must divide the query heads, the kv heads and the MLP width. We refuse rather than
    replicate kv heads (as later vLLM versions do when N > kv heads): one rule, easy to draw.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    inner = (getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None)
             or 4 * hf_config.hidden_size)
    for what, total in (("the attention heads", heads), ("the key/value heads", kv_heads),
                        ("the MLP width", inner)):
        if total % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} does not divide {what} "
                             f"({total}) of this model; choose a tensor_parallel_size that "
                             f"divides {heads} heads, {kv_heads} kv heads and {inner} MLP "
                             f"columns")
    if device.type == "cuda" and world_size > torch.cuda.device_count():
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
    """What a worker needs to build its shard (pickled to the spawned process)."""

    hf_config: object
    source: str | None
    load_format: str
    dtype: torch.dtype
    device: str
    timeout: float
    num_threads: int


# -- the worker process ----------------------------------------------------------------------------
def worker_main(fd: int) -> None:
    """Entry point of a worker process: ``fd`` is its end of a socket pair to the driver.

    NOTE: workers are fresh interpreters started with ``python -c`` (not multiprocessing's
    spawn, which re-imports the user's script and fails on scripts without a __main__ guard).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    conn = multiprocessing.connection.Connection(fd)
    try:
        rank, world_size, init_method, spec = pickle.loads(conn.recv_bytes())
        _serve(rank, world_size, conn, init_method, spec)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone: exit quietly
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        except OSError:
            pass


def _serve(rank, world_size, conn, init_method, spec: WorkerSpec) -> None:
    import datetime

    import torch.distributed as dist

    from minipaged.models.parallel_layers import set_tensor_parallel_state
    from minipaged.worker.model_runner import PreparedInputs
    from minipaged.worker.worker import LocalWorker

    device = torch.device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.num_threads)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout))
    set_tensor_parallel_state(rank, world_size)
    # This rank's shard, its cache and its runner: one process's worker, as with N = 1.
    worker = LocalWorker(spec.hf_config, spec.source, spec.load_format, spec.dtype, device)
    reply = lambda value: conn.send_bytes(pickle.dumps(("ok", value)))  # noqa: E731
    reply(worker.memory_per_rank()[0]["weights"])
    try:
        while True:
            request = pickle.loads(conn.recv_bytes())
            kind = request[0]
            if kind == "shutdown":
                return
            if kind == "profile":
                reply(worker.profile_num_gpu_blocks(*request[1:]))
            elif kind == "init_cache":
                worker.init_cache(*request[1:])
                reply(worker.memory_per_rank()[0]["kv_cache"])
            elif kind == "step":
                _, cache_ops, (input_ids, positions, meta, sample_indices) = request
                for op, arg in cache_ops:  # swap_out, swap_in, copy: in the driver's order
                    getattr(worker, op)(arg)
                inputs = PreparedInputs(input_ids.to(device), positions.to(device),
                                        _meta_to(meta, device), [], sample_indices.to(device), [])
                logits = worker.execute_model(inputs)  # (R, vocab), all ranks
                reply(logits.cpu() if rank == 0 else None)
            else:
                raise ValueError(f"unknown request {kind!r}")
    finally:
        dist.destroy_process_group()


def _meta_to(meta, device: torch.device):
    moved = {f.name: getattr(meta, f.name).to(device) for f in fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    return replace(meta, **moved)


# -- the driver's side -----------------------------------------------------------------------------
def _sender(conn, outbox: queue.Queue) -> None:
    """Send the driver's messages to one worker from a thread of their own, so that a worker
    that stops reading (hung) can never block the driver: the answer's timeout catches it."""
    while (payload := outbox.get()) is not None:
        try:
            conn.send_bytes(payload)
        except OSError:
            return


def _stop_workers(processes, conns, outboxes, rendezvous_dir, graceful: bool) -> None:
    """Stop every worker process and release what they used (idempotent)."""
    if graceful:
        for outbox in outboxes:
            outbox.put(pickle.dumps(("shutdown",)))
        deadline = time.monotonic() + 5.0
        for p in processes:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
    for outbox in outboxes:
        outbox.put(None)
    for p in processes:
        if p.poll() is None:
            p.kill()  # NOTE: SIGKILL, not SIGTERM: a stopped (hung) process ignores SIGTERM
    for p in processes:
        try:
            p.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
    for conn in conns:
        conn.close()
    shutil.rmtree(rendezvous_dir, ignore_errors=True)


class TensorParallelWorkers(Worker):
    """The driver's handle on N worker processes: the ``Worker`` interface (``worker.py``).

    The driver's own tensors (inputs, logits, sampling) stay on the CPU (``device``); the
    caches live in the workers.

    Args:
        world_size: N, the number of worker processes.
        hf_config, source, load_format: the model to build (see ``model_loader.build_model``).
        dtype, device: "cpu" (gloo) or "cuda" (NCCL, worker r on ``cuda:r``).
        timeout: seconds to wait for the workers' answer to one request.
    """

    def __init__(self, world_size: int, hf_config, source, load_format: str,
                 dtype: torch.dtype, device: torch.device,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        check_tensor_parallel(hf_config, world_size, device)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"worker_timeout must be a number of seconds > 0, got {timeout!r}")
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.worker_device = device
        self.timeout = float(timeout)
        self._error: str | None = None
        self._cache_ops: list[tuple[str, dict]] = []
        spec = WorkerSpec(hf_config, source, load_format, dtype, device.type, self.timeout,
                          max(1, (os.cpu_count() or 1) // world_size))
        self._rendezvous_dir = rendezvous_dir = tempfile.mkdtemp(prefix="minipaged-tp-")
        init_method = "file://" + os.path.join(rendezvous_dir, "rendezvous")
        self.processes: list[subprocess.Popen] = []
        self._conns, self._outboxes = [], []
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self._conns,
                                           self._outboxes, rendezvous_dir, True)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [package_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        for rank in range(world_size):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(
                [sys.executable, "-c", "import sys; from minipaged.worker.mp_workers import "
                 "worker_main; worker_main(int(sys.argv[1]))", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
            theirs.close()
            conn = multiprocessing.connection.Connection(ours.detach())
            outbox: queue.Queue = queue.Queue()
            threading.Thread(target=_sender, args=(conn, outbox), daemon=True).start()
            self.processes.append(process)
            self._conns.append(conn)
            self._outboxes.append(outbox)
            outbox.put(pickle.dumps((rank, world_size, init_method, spec)))
        self.weight_bytes: list[int] = self._wait(self.timeout * STARTUP_FACTOR, "loading")
        self.kv_cache_bytes: list[int] = [0] * world_size

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # -- what the engine calls -------------------------------------------------------------------
    def profile_num_gpu_blocks(self, max_num_batched_tokens: int, max_model_len: int,
                               gpu_memory_utilization: float, block_bytes: int) -> int | None:
        """CUDA: each rank profiles its own GPU; the pool is what the tightest rank allows."""
        if self.worker_device.type != "cuda":
            return None
        return min(self._call(("profile", max_num_batched_tokens, max_model_len,
                               gpu_memory_utilization, block_bytes), "profiling"))

    def init_cache(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                   num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate each rank's cache: the same blocks, ``num_kv_heads / N`` heads each."""
        per_rank = num_kv_heads // self.world_size
        self.kv_cache_bytes = self._call(("init_cache", num_layers, per_rank, head_size,
                                          block_size, num_gpu_blocks, num_cpu_blocks), "init")

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
        small = (inputs.input_ids.cpu(), inputs.positions.cpu(), _meta_to(inputs.meta, "cpu"),
                 inputs.sample_indices.cpu())
        return self._call(("step", cache_ops, small), "a step")[0]

    def memory_per_rank(self) -> list[dict[str, int]]:
        return [{"weights": w, "kv_cache": kv}
                for w, kv in zip(self.weight_bytes, self.kv_cache_bytes)]

    def shutdown(self) -> None:
        self._finalizer()

    # -- talking to the workers ------------------------------------------------------------------
    def _call(self, request: tuple, what: str) -> list:
        if self._error is not None:
            raise WorkerError(f"the tensor-parallel workers were stopped after an error: "
                              f"{self._error}")
        if not self._finalizer.alive:
            raise WorkerError("the tensor-parallel workers were shut down")
        payload = pickle.dumps(request)  # plain pickle: tensors are copied, no shared memory
        for outbox in self._outboxes:
            outbox.put(payload)
        try:
            return self._wait(self.timeout, what)
        except WorkerError:
            raise
        except BaseException:  # Ctrl-C mid-step: the workers' next answer would be stale
            self._stop_now(f"interrupted during {what}")
            raise

    def _wait(self, timeout: float, what: str) -> list:
        """Every worker's answer, in rank order; WorkerError if one fails, dies or is late."""
        answers: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            waiting = {self._conns[r]: r for r in range(self.world_size) if r not in answers}
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(waiting), timeout=min(max(left, 0), 0.5))
            for conn in ready:
                rank = waiting[conn]
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._died(rank, what)
                if status == "error":
                    self._fail(f"worker {rank} raised an error during {what}:\n{value}")
                answers[rank] = value
            for rank, process in enumerate(self.processes):
                if process.poll() is not None:
                    self._died(rank, what)
            if not ready and left <= 0:
                late = [r for r in range(self.world_size) if r not in answers]
                self._fail(f"worker(s) {late} did not answer within {timeout:g} s during "
                           f"{what} (hung?); raise worker_timeout if the model is just slow")
        return [answers[r] for r in range(self.world_size)]

    def _died(self, rank: int, what: str) -> None:
        process = self.processes[rank]
        try:
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        self._fail(f"worker {rank} (pid {process.pid}) died during {what} "
                   f"({_describe_exit(process.returncode)})")

    def _fail(self, message: str) -> None:
        self._stop_now(message)
        raise WorkerError(message)

    def _stop_now(self, reason: str) -> None:
        """Stop the workers without asking them (they may be dead, hung or mid-collective)."""
        self._error = reason
        if self._finalizer.detach() is not None:
            _stop_workers(self.processes, self._conns, self._outboxes, self._rendezvous_dir,
                          graceful=False)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
