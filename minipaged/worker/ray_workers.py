"""Tensor parallelism on a Ray cluster: one Ray actor per rank, on any node (lesson 14).

The same ranks as ``mp_workers.py`` (each runs a ``RankWorker`` of ``tensor_parallel.py``: its
process group, its shard, its KV cache), but Ray starts them, on whichever machines of a Ray
cluster have room:

    placement group   one bundle per rank ({"CPU": 1} on the CPU, {"GPU": 1} on CUDA), strategy
                      PACK: all ranks on one node when they fit there, spread over nodes when not
    actor r           a ``RankActor`` in bundle r (Ray gives it the bundle's CPU or GPU)
    rendezvous        rank 0's actor names its node's address and a free port there; every rank
                      joins ``torch.distributed`` at tcp://that-address:port (gloo / NCCL)
    one step          the driver sends the request to every actor (``actor.handle.remote``) and
                      waits for all answers; rank 0's answer carries the logits

The driver (scheduler, block manager, sampler) stays in the user's process and is not a rank,
exactly as with the "mp" back-end: ``TensorParallelDriver`` is shared, only ``_request`` (and
the stop function) differs.

Connecting: an engine joins the Ray connection this process already has (``ray.init`` done by
the user), else the cluster at ``$RAY_ADDRESS``, else one started with ``ray start`` on this
machine (``address="auto"``), else it starts a local one-machine cluster on 127.0.0.1 (and
stops it with the last engine that uses it).

Failures: every wait has the step timeout. An actor that dies, raises or does not answer in
time stops all actors and raises ``WorkerError`` naming the rank. Shutdown (``shutdown()``,
``del``, interpreter exit) kills the actors and removes the placement group.

NOTE: Ray is imported only here, and only when an engine asks for ``"ray"``.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import weakref

import torch

from minipaged.child_process import path_variable
from minipaged.config import RAY_MISSING
from minipaged.worker.tensor_parallel import (DEFAULT_TIMEOUT_S, STARTUP_FACTOR, RankWorker,
                                              TensorParallelDriver, WorkerSpec,
                                              check_tensor_parallel)

CPUS_PER_RANK = 1  # one CPU per rank's bundle on the CPU (a scheduling unit: Ray's, not a core)
_connection = {"users": 0, "opened": False}  # engines using the Ray connection we opened


def import_ray():
    """``ray``, or a ValueError naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ValueError(RAY_MISSING) from None
    return ray


class RankActor:
    """What runs inside each rank's Ray actor: a ``RankWorker``, once the rendezvous is known."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None

    def where(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def free_port(self) -> int:
        """A port that is free on this actor's node address (rank 0's: the rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def start(self, rank: int, world_size: int, init_method: str, spec: WorkerSpec) -> int:
        if "127.0.0.1" in init_method and "GLOO_SOCKET_IFNAME" not in os.environ:
            # NOTE: a cluster on the loopback address keeps gloo's traffic there too (gloo
            # otherwise uses the address the host name resolves to).
            loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
            if loopback:
                os.environ["GLOO_SOCKET_IFNAME"] = loopback[0]
        # Ray shows the actor only the GPU of its bundle: it is device 0 here.
        self.worker = RankWorker(rank, world_size, init_method, spec, gpu_index=0)
        return self.worker.weight_bytes()

    def handle(self, request: tuple):
        return self.worker.handle(request)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def actor_runtime_env() -> dict:
    """The actors' Ray runtime environment: the driver's ``sys.path`` first on theirs, so that
    they import the minipaged (and transformers, ...) the driver imports, however it is
    installed (``child_process.py``; the paths must exist on every node, as the model must)."""
    return {"env_vars": {"PYTHONPATH": path_variable()}}


# -- the connection to the cluster -----------------------------------------------------------------
def _connect(ray, world_size: int) -> bool:
    """Use this process's Ray connection, or open one (see the module's docstring); True when
    the connection is one minipaged opened (the last engine using it closes it)."""
    if ray.is_initialized():
        return _connection["opened"]
    quiet = dict(logging_level=logging.WARNING, log_to_driver=False)
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **quiet)
    else:
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError:  # no cluster on this machine: start one, on the loopback only
            cpus = max(os.cpu_count() or 1, world_size * CPUS_PER_RANK)
            ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     **quiet)
    _connection["opened"] = True
    return True


def _release(ray) -> None:
    _connection["users"] -= 1
    if _connection["users"] <= 0 and _connection["opened"]:
        _connection.update(users=0, opened=False)
        ray.shutdown()


def _stop_actors(ray, actors: list, placement_groups: list, holds_connection: bool,
                 graceful: bool = True) -> None:
    """Kill every actor, remove the placement group, leave the connection (once)."""
    from ray.util.placement_group import remove_placement_group

    try:
        if graceful and actors and ray.is_initialized():
            try:  # leave the process group cleanly; a rank that cannot is killed anyway
                ray.get([a.close.remote() for a in actors], timeout=5.0)
            except Exception:
                pass
        for actor in actors:
            try:
                ray.kill(actor)  # NOTE: no restart; a hung (stopped) actor's process is killed
            except Exception:
                pass
        for pg in placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
    finally:
        if holds_connection:
            _release(ray)


class RayTensorParallelWorkers(TensorParallelDriver):
    """The driver's handle on N Ray actors: the same ``Worker`` interface as the processes of
    ``mp_workers.py``.

    Args:
        world_size: N, the number of ranks (actors).
        hf_config, source, load_format: the model to build; ``source`` must be readable at the
            same path on every node (or be a Hugging Face id every node can fetch).
        dtype, device: "cpu" (gloo, one CPU a rank) or "cuda" (NCCL, one GPU a rank).
        timeout: seconds to wait for the ranks' answer to one request.
    """

    def __init__(self, world_size: int, hf_config, source, load_format: str,
                 dtype: torch.dtype, device: torch.device,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        check_tensor_parallel(hf_config, world_size, device, gpus_on_this_machine=False)
        self._init_driver(world_size, device, timeout)
        self._ray = ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        holds_connection = _connect(ray, world_size)
        if holds_connection:
            _connection["users"] += 1
        self.actors: list = []
        self._placement_groups: list = []  # (one, once made)
        self._finalizer = weakref.finalize(self, _stop_actors, ray, self.actors,
                                           self._placement_groups, holds_connection)
        cuda = device.type == "cuda"
        bundle = {"GPU": 1} if cuda else {"CPU": CPUS_PER_RANK}
        self._check_room(bundle)
        self.placement_group = pg = placement_group([bundle] * world_size, strategy="PACK")
        self._placement_groups.append(pg)
        if not ray.wait([pg.ready()], timeout=self.timeout)[0]:
            self._fail(f"the Ray cluster did not find room for {world_size} bundles of "
                       f"{bundle} within {self.timeout:g} s (free now: "
                       f"{ray.available_resources()})")
        actor_class = ray.remote(RankActor)
        for rank in range(world_size):
            self.actors.append(actor_class.options(
                num_cpus=0 if cuda else CPUS_PER_RANK, num_gpus=1 if cuda else 0,
                runtime_env=actor_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank)).remote())
        startup = self.timeout * STARTUP_FACTOR
        self.placement: list[dict] = self._gather([a.where.remote() for a in self.actors],
                                                  startup, "placing the ranks")
        port = self._gather([self.actors[0].free_port.remote()], startup, "the rendezvous")[0]
        host = self.placement[0]["ip"]
        init_method = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        spec = WorkerSpec(hf_config, source, load_format, dtype, device.type, self.timeout,
                          CPUS_PER_RANK)
        self.weight_bytes = self._gather(
            [a.start.remote(r, world_size, init_method, spec) for r, a in enumerate(self.actors)],
            startup, "loading")

    def _check_room(self, bundle: dict) -> None:
        """Refuse at once a cluster that can never hold N bundles (Ray would wait forever)."""
        (kind, need), = bundle.items()
        total = self._ray.cluster_resources().get(kind, 0)
        if total < need * self.world_size:
            self._finalizer()
            raise ValueError(f"tensor_parallel_size {self.world_size} needs {self.world_size} "
                             f"x {need} {kind} on the Ray cluster, which has {total:g} {kind} "
                             f"in all; add nodes (ray start --address=...) or lower "
                             f"tensor_parallel_size")

    # -- talking to the actors -------------------------------------------------------------------
    def _request(self, request: tuple, what: str) -> list:
        return self._gather([a.handle.remote(request) for a in self.actors], self.timeout, what)

    def _gather(self, refs: list, timeout: float, what: str) -> list:
        """The answers of ``refs`` (one per rank, in rank order); WorkerError if a rank fails,
        dies or is late."""
        from ray.exceptions import RayActorError, RayError

        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        answers: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(left, 0.0))
            if not ready:
                late = sorted(pending.values())
                self._fail(f"rank(s) {late} did not answer within {timeout:g} s during {what} "
                           f"(hung?); raise worker_timeout if the model is just slow")
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    answers[rank] = ray.get(ref)
                except RayActorError as e:
                    self._fail(f"rank {rank} (Ray actor on {self._node_of(rank)}) died during "
                               f"{what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                except RayError as e:
                    self._fail(f"rank {rank} raised an error during {what}:\n{e}")
        return [answers[r] for r in range(len(refs))]

    def _node_of(self, rank: int) -> str:
        placement = getattr(self, "placement", None)
        if not placement:
            return "an unknown node"
        return f"node {placement[rank]['ip']} {placement[rank]['node_id'][:8]}"
