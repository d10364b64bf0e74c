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
                                 {"GPU": 1} on CUDA), PACK or SPREAD: a
                                 request the cluster's total resources can
                                 never satisfy fails at once; one that could
                                 be satisfied later (resources in use) must be
                                 ready within the timeout, or is removed;
                                 either way WorkerStartupError names what is
                                 missing; ``tick`` (the start's cancel
                                 check) runs every ``tick_s`` of the wait,
                                 and the group is removed if it raises
    actor_runtime_env(...)       the driver's own code directories (sys.path
                                 entries outside site-packages and the
                                 standard library that a Ray worker would not
                                 have) as the actors' PYTHONPATH, so that a
                                 worker class importable here is importable
                                 there; None when there is nothing to add
    RaySession.close()           ray.shutdown() only for a Ray this module
                                 started, once its last executor is done

Ray is imported here, lazily, and nowhere else in the driver: ``import
mpexec.executor`` works without it, and a missing Ray becomes one clear
error when a Ray executor is built.
"""

from __future__ import annotations

import glob
import logging
import os
import site
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpexec.errors import WorkerStartupError

logger = logging.getLogger("mpexec.executor.ray.executor")

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


def _library_dirs() -> list[str]:
    """Where installed code lives: site-packages and the standard library."""
    paths = sysconfig.get_paths()
    dirs = [paths.get("stdlib", ""), paths.get("platstdlib", ""), paths.get("purelib", ""),
            paths.get("platlib", ""), *site.getsitepackages()]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else ""
    return [os.path.realpath(d) for d in (*dirs, user) if d]


def _pth_dirs(site_dirs: Sequence[str]) -> set[str]:
    """Directories that ``.pth`` files add to every interpreter (editable installs)."""
    found: set[str] = set()
    for directory in site_dirs:
        for pth in glob.glob(os.path.join(directory, "*.pth")):
            try:
                with open(pth) as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            for line in lines:
                if line and not line.startswith(("#", "import ")):
                    found.add(os.path.realpath(os.path.join(directory, line)))
    return found


def driver_code_paths(path: Sequence[str] | None = None) -> list[str]:
    """The driver's ``sys.path`` entries a Ray worker does not get by itself.

    Left out: site-packages and the standard library (every interpreter has
    them), directories that ``.pth`` files add (so does every interpreter of
    the same environment), entries that are not directories (zips).
    """
    libs = _library_dirs()
    pth = _pth_dirs(site.getsitepackages())
    found: list[str] = []
    for entry in sys.path if path is None else path:
        real = os.path.realpath(entry or os.curdir)
        if not os.path.isdir(real) or real in pth or real in found:
            continue
        if any(real == lib or real.startswith(lib + os.sep) for lib in libs):
            continue
        found.append(real)
    return found


def actor_runtime_env(session: RaySession,
                      path: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The actors' runtime environment: the driver's code directories on their
    PYTHONPATH, or None when they have them already.

    A Ray worker gets the driver's working directory (Ray adds it) and, on a
    Ray this process started, the driver's ``PYTHONPATH`` (inherited through
    the raylet); anything else on the driver's ``sys.path`` (a ``sys.path``
    insert, a script's directory) travels as ``env_vars``.  Setting no
    runtime environment when nothing is missing keeps Ray's pooled workers
    usable (a runtime environment of its own starts a fresh worker process).
    """
    code = driver_code_paths(path)
    inherited = [os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]
    have = {os.path.realpath(os.curdir)}
    if session.started:
        have.update(inherited)
    if all(p in have for p in code):
        return None
    joined = list(dict.fromkeys([*code, *inherited]))
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(joined)}}


def bundles_for(world_size: int, device_type: str) -> list[dict[str, float]]:
    bundle: dict[str, float] = {"CPU": 1.0}
    if device_type == "cuda":
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(world_size)]


def place_workers(session: RaySession, bundles: list[dict[str, float]], strategy: str,
                  timeout_s: float, tick: Callable[[], None] = lambda: None,
                  tick_s: float = 0.05) -> Any:
    """A ready placement group for ``bundles``, or WorkerStartupError (see above)."""
    ray = session.ray
    from ray.util.placement_group import placement_group, remove_placement_group

    impossible = never_satisfiable(ray, bundles)
    if impossible is not None:
        raise WorkerStartupError(
            f"the placement group of {len(bundles)} worker(s) ({strategy}) can never be "
            f"placed on this Ray cluster: {impossible}")
    group = placement_group(bundles, strategy=strategy)
    try:
        placed = _wait_placed(ray, group, timeout_s, tick, tick_s)
    except BaseException:
        remove_placement_group(group)
        raise
    if placed:
        return group
    remove_placement_group(group)
    raise WorkerStartupError(
        f"the placement group of {len(bundles)} worker(s) ({strategy}) could not be placed "
        f"within {timeout_s:g}s (ray_placement_timeout_s): {missing_resources(ray, bundles)}")


def _wait_placed(ray: Any, group: Any, timeout_s: float, tick: Callable[[], None],
                 tick_s: float) -> bool:
    """Whether ``group`` is placed within ``timeout_s``; ``tick()`` (which may
    raise) between slices of ``tick_s``."""
    ready = group.ready()
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if ray.wait([ready], timeout=max(0.0, min(remaining, tick_s)))[0]:
            return True
        if remaining <= tick_s:
            return False
        tick()


def _totals(bundles: list[dict[str, float]]) -> dict[str, float]:
    needed: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount
    return needed


def never_satisfiable(ray: Any, bundles: list[dict[str, float]]) -> str | None:
    """Why the cluster as it is can never hold ``bundles`` (None: it can, maybe later).

    Two checks against what the cluster has in total, used or not: the sum
    of each resource, and each bundle against the largest live node (a
    bundle never spans nodes).  A cluster that grows (an autoscaler, nodes
    still joining) is judged as it is now.
    """
    total = ray.cluster_resources()
    needed = _totals(bundles)
    short = [f"{name} {amount:g} needed, {total.get(name, 0.0):g} in the cluster"
             for name, amount in sorted(needed.items()) if total.get(name, 0.0) < amount]
    if short:
        return "; ".join(short)
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    for bundle in bundles:
        if nodes and not any(all(res.get(name, 0.0) >= amount for name, amount in bundle.items())
                             for res in nodes):
            return (f"no node has {bundle} for one worker (a worker's bundle never spans "
                    "nodes)")
    return None


def missing_resources(ray: Any, bundles: list[dict[str, float]]) -> str:
    """Which resources the cluster lacks for ``bundles``, in words."""
    needed = _totals(bundles)
    total = ray.cluster_resources()
    free = ray.available_resources()
    short = [f"{name} {amount:g} needed, {total.get(name, 0.0):g} in the cluster "
             f"({free.get(name, 0.0):g} free)"
             for name, amount in sorted(needed.items()) if free.get(name, 0.0) < amount]
    if not short:
        return (f"needs {needed}; the cluster has them in total but not in the shape asked "
                "(one bundle per worker; SPREAD needs one node per worker)")
    return "missing " + "; ".join(short)


def bundle_nodes(ray: Any, group: Any, world_size: int) -> tuple[str, ...]:
    """The Ray node of each bundle of a placed group (bundle index = rank)."""
    by_bundle = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return tuple(str(by_bundle[rank]) for rank in range(world_size))


def remove_group(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:
        logger.debug("removing the placement group failed", exc_info=True)
