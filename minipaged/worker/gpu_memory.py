"""How much GPU memory an engine may take, who holds the rest, and giving it back (lesson 15).

One process may hold several engines: a notebook compares two (lessons 11, 12 and 16), and a
re-run cell builds a new engine while the old one is still bound to the name. So an engine's
KV pool is sized against what THIS process may still take when the engine starts, never against
the card's total:

    available   = free memory (``torch.cuda.mem_get_info``)
                + what torch's caching allocator holds reserved but unused (this process reuses
                  it; no other process can)
    pool bytes  = available * gpu_memory_utilization - (weights + activations of the largest
                  step, profiled: ``model_loader.profile_num_gpu_blocks``)

A second engine therefore gets ``gpu_memory_utilization`` of what the first one left, and when
that is too little the error names what holds the rest: other engines alive in this process
(with their sizes), other tensors, other processes. An engine that is shut down, or deleted and
collected, drops its tensors and hands torch's cached blocks back to the device (``release``),
so the next engine finds them free.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

GiB = float(1 << 30)

# The workers alive in this process whose pools live on a GPU (weak: a dead engine leaves).
_LIVE_WORKERS: weakref.WeakSet = weakref.WeakSet()


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a CUDA device's memory, as this process sees it (bytes)."""

    total: int  # the card's memory
    free: int  # not held by anyone (the driver's count)
    reserved: int  # held by this process's torch caching allocator
    allocated: int  # of that, in tensors now

    @property
    def available(self) -> int:
        """What this process may still take: free memory and torch's unused cached blocks."""
        return self.free + max(self.reserved - self.allocated, 0)

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total=int(total), free=int(free),
                   reserved=int(torch.cuda.memory_reserved(device)),
                   allocated=int(torch.cuda.memory_allocated(device)))


def kv_pool_bytes(available: float, gpu_memory_utilization: float, engine_peak: float) -> int:
    """Bytes the KV pool gets: the engine's share of what was available when it started, less
    the peak its weights and a profiled largest step reached (never below 0).

    Args:
        available: ``DeviceMemory.available`` read before the engine loaded its weights.
        gpu_memory_utilization: the share of that the engine may use, in (0, 1].
        engine_peak: the engine's own peak: weights plus the profiled step's activations.
    """
    return max(int(available * gpu_memory_utilization - engine_peak), 0)


def register(worker) -> None:
    """Count ``worker`` (it has ``device`` and ``memory_per_rank()``) among the live engines."""
    _LIVE_WORKERS.add(worker)


def other_engines(worker) -> list[dict[str, int]]:
    """Weights and KV pool bytes of every other live engine on ``worker``'s device."""
    found = []
    for other in list(_LIVE_WORKERS):
        if other is not worker and other.device == worker.device:
            found.append(other.memory_per_rank()[0])
    return [m for m in found if m["weights"] or m["kv_cache"]]  # (a shut-down one holds none)


def holders_report(worker, needed: int | None = None) -> str:
    """Who holds ``worker``'s device memory, and which settings give some back.

    Args:
        worker: the engine's worker (excluded from "other engines").
        needed: bytes the engine wanted and could not get, if any.
    """
    mem = DeviceMemory.read(worker.device)
    others = other_engines(worker)
    own = worker.memory_per_rank()[0]
    held_by_others = sum(m["weights"] + m["kv_cache"] for m in others)
    rest_of_process = max(mem.allocated - held_by_others - own["weights"] - own["kv_cache"], 0)
    other_processes = max(mem.total - mem.free - mem.reserved, 0)
    lines = [f"{worker.device} has {gib(mem.total)}: {gib(mem.available)} available to this "
             f"process ({gib(mem.free)} free, {gib(max(mem.reserved - mem.allocated, 0))} "
             f"cached by torch)"
             + (f", this engine wanted {gib(needed)}" if needed is not None else "")
             + f"; this engine's weights take {gib(own['weights'])}."]
    if others:
        each = "; ".join(f"weights {gib(m['weights'])} + KV pool {gib(m['kv_cache'])}"
                         for m in others)
        lines.append(f"{len(others)} other engine(s) alive in this process hold "
                     f"{gib(held_by_others)} ({each}): shut them down (llm.shutdown(), or del "
                     f"llm and gc.collect()), or build them with a smaller pool "
                     f"(gpu_memory_utilization= or num_gpu_blocks=).")
    lines.append(f"Other tensors of this process hold {gib(rest_of_process)}; other processes "
                 f"and the CUDA contexts {gib(other_processes)}.")
    lines.append("This engine needs less with a smaller num_gpu_blocks=, max_model_len= or "
                 "max_num_batched_tokens=.")
    return " ".join(lines)


@contextlib.contextmanager
def naming_memory_holders(worker):
    """A ValueError raised inside (the pool did not fit) also says who holds the GPU memory:
    ``worker.memory_report()``, when it has one (on CUDA)."""
    try:
        yield
    except ValueError as e:
        note = worker.memory_report()
        if not note:
            raise
        raise ValueError(f"{e}. {note}") from None


def release(attrs: dict, names: tuple[str, ...], on_gpu: bool) -> None:
    """Drop the tensors a worker holds and give torch's cached blocks back to the device.

    NOTE: called by ``LocalWorker.shutdown`` and by its finalizer when the worker is collected
    (``del llm``): the finalizer may not hold the worker, so it gets the worker's attribute
    dict and empties the named attributes itself; only then are the tensors free, and only
    then can ``torch.cuda.empty_cache`` return their blocks.

    Args:
        attrs: the worker's ``__dict__``.
        names: the attributes that hold tensors (the model, its runner, the cache engine).
        on_gpu: whether those tensors were on a CUDA device.
    """
    graphs = getattr(attrs.get("model_runner"), "graph_runner", None)
    if graphs is not None:
        graphs.release()  # the graphs' private memory pool goes back to torch's cache
    del graphs  # (a local reference would keep the model alive past empty_cache)
    for name in names:
        attrs[name] = None
    if on_gpu:
        torch.cuda.empty_cache()
