"""A Ray cluster of several nodes on this one machine, on 127.0.0.1 only (lesson 14, tests).

``simulated_cluster(n)`` starts Ray's own ``ray.cluster_utils.Cluster`` with ``n`` nodes (each
a raylet of its own, one CPU each, no dashboard), every node and the GCS on the loopback
address, connects this process to it, and on leaving stops it all and checks that no process of
it is left. With one CPU a node and a bundle of one CPU a rank, the ``"ray"`` back-end's PACK
placement group puts one rank on each node: the network between the ranks is real TCP, only the
machines are not.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

LOOPBACK = "127.0.0.1"
# NOTE: Ray's switch for clusters on one machine; off, Ray takes 127.0.0.1 as every node's
# address. Ray reads it at import (this process) and at start (the nodes inherit it).
_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _children() -> set[int]:
    """The live processes this one started: its descendants, and the Ray processes of its
    process group whose parent has died (a node's agents outlive a raylet that crashed)."""
    import psutil

    group = os.getpgid(0)
    found = set()
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.info["pid"] == os.getpid():
                continue  # (a zombie has exited)
            command = " ".join(p.info["cmdline"] or [])
            if p.info["ppid"] == 1 and os.getpgid(p.info["pid"]) == group and "ray" in command:
                found.add(p.info["pid"])
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.pid)
    return found


def _kill(pids) -> None:
    import psutil

    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def _start(ray_cluster_class, num_nodes: int, cpus_per_node: int):
    args = dict(num_cpus=cpus_per_node, node_ip_address=LOOPBACK)
    cluster = ray_cluster_class(initialize_head=True,
                                head_node_args=dict(args, include_dashboard=False))
    for _ in range(num_nodes - 1):
        cluster.add_node(**args)
    cluster.wait_for_nodes()
    return cluster


@contextlib.contextmanager
def simulated_cluster(num_nodes: int = 2, cpus_per_node: int = 1, attempts: int = 3):
    """Yield a started ``Cluster`` of ``num_nodes`` nodes on 127.0.0.1, connected (``ray.init``).

    After the block, ``cluster.left_behind`` lists the pids of the cluster's processes that
    outlived its shutdown (they are killed; a correct run leaves it empty).

    NOTE: a starting node gives its agents 15 s to come up; on a machine busy with other work
    that can fail, so a failed start is cleaned up and tried again (``attempts`` times).
    """
    saved = os.environ.get(_SWITCH)
    os.environ[_SWITCH] = "0"
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    saved_constant = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # (for a Ray imported before the switch was set)
    cluster, ours = None, set()
    try:
        for attempt in range(attempts):
            before = _children()
            try:
                cluster = _start(Cluster, num_nodes, cpus_per_node)
                break
            except Exception:
                time.sleep(1.0)
                _kill(_children() - before)  # the half-started nodes: ours
                if attempt == attempts - 1:
                    raise
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        ours = _children()
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
            deadline = time.monotonic() + 60  # (a GCS on a busy machine took over 20 s to go)
            while (_children() & ours) and time.monotonic() < deadline:
                time.sleep(0.2)
            cluster.left_behind = sorted(_children() & ours)
            _kill(cluster.left_behind)
        ray_constants.ENABLE_RAY_CLUSTER = saved_constant
        if saved is None:
            os.environ.pop(_SWITCH, None)
        else:
            os.environ[_SWITCH] = saved
