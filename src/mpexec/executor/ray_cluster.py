"""Ray itself for RayExecutor: the connection, the placement group, the actors.

::

    RaySession.open(address)     ray.init(address=...) to join a cluster (the
                                 configured one, else RAY_ADDRESS), or a new
                                 local Ray (address="local": never one that
                                 `ray start` left running; num_cpus from this
                                 machine, no dashboard, worker logs not
                                 forwarded); a Ray this process already
                                 initialised is reused
    place_workers(...)           one bundle per worker ({"CPU": 1}, plus
                                 {"GPU": 1} on CUDA), PACK or SPREAD; ready
                                 within the timeout, or removed and
                                 WorkerStartupError naming what is missing
    RaySession.close()           ray.shutdown() only for a Ray this module
                                 started, once its last executor is done

Ray is imported here, lazily, and nowhere else in the driver: ``import
mpexec.executor`` works without it, and a missing Ray becomes one clear
error when a Ray executor is built.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from mpexec.errors import WorkerStartupError

logger = logging.getLogger("mpexec.executor.ray")

# Executors using the local Ray that this module started (it stops with the last).
_local_users = 0
_local_lock = threading.Lock()


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError("executor_backend 'ray' needs Ray: pip install 'mpexec[ray]'") from exc
    return ray


class RaySession:
    """This executor's use of Ray; ``started`` when it runs a Ray it started."""

    def __init__(self, ray: Any, started: bool) -> None:
        self.ray = ray
        self.started = started
        self._closed = False

    @classmethod
    def open(cls, address: str | None) -> RaySession:
        global _local_users
        ray = import_ray()
        with _local_lock:
            if ray.is_initialized():
                # Ours (another executor's) or the application's: share it.
                started = _local_users > 0
            elif (join := _cluster_to_join(address)) is not None:
                ray.init(address=join, log_to_driver=False, configure_logging=False)
                started = False
            else:
                # "local": a Ray of our own.  With no address Ray would join
                # whatever `ray start` last ran on this machine.
                ray.init(address="local", num_cpus=os.cpu_count() or 1,
                         include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
                started = True
            if started:
                _local_users += 1
        return cls(ray, started)

    @property
    def node_id(self) -> str:
        return str(self.ray.get_runtime_context().get_node_id())

    def close(self) -> None:
        """Stop the Ray this module started once no executor uses it; idempotent."""
        global _local_users
        if self._closed:
            return
        self._closed = True
        if not self.started:
            return
        with _local_lock:
            _local_users -= 1
            if _local_users == 0 and self.ray.is_initialized():
                self.ray.shutdown()


def _cluster_to_join(address: str | None) -> str | None:
    """The configured address, else ``RAY_ADDRESS`` (set inside a Ray job), else None."""
    return address if address is not None else os.environ.get("RAY_ADDRESS") or None


def bundles_for(world_size: int, device_type: str) -> list[dict[str, float]]:
    bundle: dict[str, float] = {"CPU": 1.0}
    if device_type == "cuda":
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(world_size)]


def place_workers(session: RaySession, bundles: list[dict[str, float]], strategy: str,
                  timeout_s: float) -> Any:
    """A ready placement group for ``bundles``, or WorkerStartupError (see above)."""
    ray = session.ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready:
        return group
    remove_placement_group(group)
    raise WorkerStartupError(
        f"the placement group of {len(bundles)} worker(s) ({strategy}) could not be placed "
        f"within {timeout_s:g}s (ray_placement_timeout_s): {missing_resources(ray, bundles)}")


def missing_resources(ray: Any, bundles: list[dict[str, float]]) -> str:
    """Which resources the cluster lacks for ``bundles``, in words."""
    needed: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount
    total = ray.cluster_resources()
    free = ray.available_resources()
    short = [f"{name} {amount:g} needed, {total.get(name, 0.0):g} in the cluster "
             f"({free.get(name, 0.0):g} free)"
             for name, amount in sorted(needed.items()) if free.get(name, 0.0) < amount]
    if not short:
        return (f"needs {needed}; the cluster has them in total but not in the shape asked "
                "(one bundle per worker; SPREAD needs one node per worker)")
    return "missing " + "; ".join(short)


def remove_group(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:
        logger.debug("removing the placement group failed", exc_info=True)
