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
import tempfile
import threading
import time
import traceback
import weakref

import torch

from minipaged.child_process import python_argv
from minipaged.worker.tensor_parallel import (DEFAULT_TIMEOUT_S, STARTUP_FACTOR, RankWorker,
                                              TensorParallelDriver, WorkerSpec,
                                              check_tensor_parallel)


# -- the worker process ----------------------------------------------------------------------------
# What a worker process runs: a fresh interpreter with the driver's own sys.path
# (``child_process.py``), so it imports the same minipaged, transformers, ... as the driver.
WORKER_MAIN = "from minipaged.worker.mp_workers import worker_main; worker_main(int(sys.argv[1]))"


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
    """The rank's loop: a ``RankWorker`` (``tensor_parallel.py``) answers each request."""
    worker = RankWorker(rank, world_size, init_method, spec)
    reply = lambda value: conn.send_bytes(pickle.dumps(("ok", value)))  # noqa: E731
    reply(worker.weight_bytes())
    try:
        while True:
            request = pickle.loads(conn.recv_bytes())
            if request[0] == "shutdown":
                return
            reply(worker.handle(request))
    finally:
        worker.close()


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


class TensorParallelWorkers(TensorParallelDriver):
    """The driver's handle on N worker processes: the ``Worker`` interface (``worker.py``),
    through ``TensorParallelDriver`` (``tensor_parallel.py``); this class adds the processes.

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
        self._init_driver(world_size, device, timeout)
        spec = WorkerSpec(hf_config, source, load_format, dtype, device.type, self.timeout,
                          max(1, (os.cpu_count() or 1) // world_size))
        rendezvous_dir = tempfile.mkdtemp(prefix="minipaged-tp-")
        init_method = "file://" + os.path.join(rendezvous_dir, "rendezvous")
        self.processes: list[subprocess.Popen] = []
        self._conns, self._outboxes = [], []
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self._conns,
                                           self._outboxes, rendezvous_dir, graceful=True)
        for rank in range(world_size):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(python_argv(WORKER_MAIN, theirs.fileno()),
                                       pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            theirs.close()
            conn = multiprocessing.connection.Connection(ours.detach())
            outbox: queue.Queue = queue.Queue()
            threading.Thread(target=_sender, args=(conn, outbox), daemon=True).start()
            self.processes.append(process)
            self._conns.append(conn)
            self._outboxes.append(outbox)
            outbox.put(pickle.dumps((rank, world_size, init_method, spec)))
        self.weight_bytes = self._wait(self.timeout * STARTUP_FACTOR, "loading")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # -- talking to the workers ------------------------------------------------------------------
    def _request(self, request: tuple, what: str) -> list:
        payload = pickle.dumps(request)  # plain pickle: tensors are copied, no shared memory
        for outbox in self._outboxes:
            outbox.put(payload)
        return self._wait(self.timeout, what)

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


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
