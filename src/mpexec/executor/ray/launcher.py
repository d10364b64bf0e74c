"""RayActorLauncher: Ray actors as the executor's workers, with their own watches.

The launcher seam (``executor.launcher``) for Ray: it starts the actors,
brings the watches that say when one is gone or stalled, and hands the
lifecycle one :class:`RayWorkerHandle` (a ``WatchedWorker``) per actor::

    RayActorLauncher(session, placement group, each rank's Ray node, config)
    watch_stalls(stall)      the driver's StallWatch judges the actors of its
                             own Ray node (``stall.only``); each other Ray node
                             that hosts ranks gets a watch actor (``watch``)
    start(ctx, broadcast handle, queues)
                             one actor in bundle ``ctx.local_rank``; its heartbeat
                             stamps the segment of whoever watches its node
      -> RayWorkerHandle     liveness: ``wait_exit()`` in the "supervise" group
    watch_deaths()           one thread waits on every liveness ref and every
                             node watch's verdict: an actor gone (or found
                             stalled) writes its handle's death pipe, which the
                             lifecycle's monitor polls as it polls a pidfd
    close()                  stop that thread, kill the watch actors

The handle ends its actor the way the lifecycle ends any worker, through
``terminate`` and ``kill`` (``ray.kill``: Ray has nothing gentler), never by
closing a pipe: an actor has no death pipe (``ends_on_close`` is False, so
the teardown does not wait for it to leave by itself).  Its gentle end, the
worker's own ``shutdown()``, runs before the teardown (``executor._close``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.executor.context import WorkerContext
from mpexec.executor.launcher import WorkerExit
from mpexec.executor.ray.actor import SUPERVISE_GROUP, RayWorkerActor
from mpexec.executor.ray.cluster import RaySession
from mpexec.executor.ray.queues import ActorQueues
from mpexec.executor.ray.watch import RayNodeWatch
from mpexec.executor.stall import Stall, StallWatch
from mpexec.ipc import Handle

logger = logging.getLogger(__name__)

_WATCH_SLICE_S = 0.2
_DEATH_LAG_S = 1.0
_CAUSE_WAIT_S = 1.0
_WATCH_END_S = 10.0


class RayWorkerHandle:
    """One actor as the lifecycle sees a worker (``launcher.WatchedWorker``)."""

    def __init__(self, ray: Any, rank: int, actor: Any, driver_node: str,
                 remote_lag_s: float) -> None:
        self.ray = ray
        self.rank = rank
        self.actor = actor
        self.driver_node = driver_node
        self.remote_lag_s = remote_lag_s
        # Resolves (with an error) once the actor is gone, however it went.
        self.liveness = actor.wait_exit.options(concurrency_group=SUPERVISE_GROUP).remote()
        self.pid: int | None = None
        self.node_id = "?"
        # Written by the actors' death watch when Ray reports the actor gone:
        # the lifecycle's monitor polls it like a local worker's pidfd.
        self._death_r, self._death_w = os.pipe()
        self._fd_lock = threading.Lock()
        # Its node's stall watch found it stopped or hung (``watch``).
        self.stall: Stall | None = None

    @property
    def death_fd(self) -> int:
        return self._death_r

    def gone(self) -> None:
        """The death watch saw the actor's liveness ref resolve."""
        with self._fd_lock:
            if self._death_w >= 0:
                os.write(self._death_w, b"x")

    def stalled(self, stall: Stall) -> None:
        """Its node's watch found it stopped or hung: the lifecycle kills it."""
        self.stall = stall
        self.gone()

    @property
    def name(self) -> str:
        return f"RayWorker-{self.rank}"

    @property
    def death_lag_s(self) -> float:
        """An actor on another Ray node closes its queues before Ray reports it
        (or its node) gone: as long as a follower node's verdict."""
        if self.node_id in ("?", self.driver_node):
            return _DEATH_LAG_S
        return max(_DEATH_LAG_S, self.remote_lag_s)

    def is_alive(self) -> bool:
        ready, _ = self.ray.wait([self.liveness], timeout=0)
        return not ready

    def why_gone(self) -> str:
        """The node and Ray's reason, for WorkerDiedError."""
        where = f"the Ray actor on node {self.node_id}"
        if self.is_alive():
            return f"{where} closed its queues"
        # The first error Ray raises may predate the cause reaching the GCS
        # ("... died because its node has died"): ask again, briefly.
        detail, deadline = "", time.monotonic() + _CAUSE_WAIT_S
        while True:
            try:
                self.ray.get(self.liveness, timeout=0)
                return f"{where} exited"
            except Exception as exc:
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                cause = next((line for line in lines if " because " in line
                              or "exit detail" in line.lower()), None)
                detail = f"{type(exc).__name__}: {cause or (lines[0] if lines else '')}"
            if cause is not None or time.monotonic() >= deadline:
                return f"{where} is gone ({detail})"
            time.sleep(0.05)

    def terminate(self) -> None:
        self.kill()  # Ray has no gentler signal than its own kill

    def kill(self) -> None:
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:
            logger.debug("ray.kill(%s) failed", self.name, exc_info=True)

    def join(self, timeout: float | None) -> None:
        self.ray.wait([self.liveness], timeout=timeout)

    def describe_exit(self) -> WorkerExit:
        stall = self.stall
        if stall is not None:
            return WorkerExit(self.rank, stall.pid, None,
                              f"on Ray node {self.node_id} {stall.how}", stalled=stall.seen)
        return WorkerExit(self.rank, self.pid, None, self.why_gone(),
                          who=f"worker rank {self.rank} (pid {self.pid})")

    # An actor does not end when its death pipe closes: it has none.  Its
    # gentle end, the worker's own shutdown, ran before the teardown
    # (``executor._close``); what is left is ending the actor (``terminate``).
    ends_on_close = False

    def close_death_pipe(self) -> None:
        pass

    def end_group(self) -> None:
        pass

    def close(self) -> None:
        with self._fd_lock:
            for fd in (self._death_r, self._death_w):
                if fd >= 0:
                    os.close(fd)
            self._death_r = self._death_w = -1

    def __repr__(self) -> str:
        return f"<ray worker rank {self.rank} pid {self.pid} node {self.node_id}>"


class RayActorLauncher:
    """Starts the actors and watches them; see the module docstring."""

    def __init__(self, session: RaySession, group: Any, rank_nodes: tuple[str, ...],
                 config: ExecutorConfig, runtime_env: dict[str, Any] | None) -> None:
        self.session = session
        self.ray = ray = session.ray
        self.group = group
        self.rank_nodes = rank_nodes
        self.config = config
        self.options: dict[str, Any] = {} if runtime_env is None else {
            "runtime_env": runtime_env}
        gpus = 1 if config.device_type == "cuda" else 0
        # "supervise": wait_exit (the liveness probe), beside the calls.
        self.actor_cls = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0,
                                    concurrency_groups={SUPERVISE_GROUP: 1})(RayWorkerActor)
        self.remote_lag_s = config.node_timeout_s + 2 * config.node_heartbeat_s
        self.handles: list[RayWorkerHandle] = []
        self.stall: StallWatch | None = None
        # The stall watch actor of each Ray node other than the driver's.
        self.node_watches: dict[str, Any] = {}
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch_stalls(self, stall: StallWatch) -> None:
        """Who judges each actor's stalls: ``stall`` (the driver's) for the
        actors on the driver's Ray node, a ``RayNodeWatch`` actor on each other."""
        here = self.session.node_id
        self.stall = stall
        stall.only = frozenset(r for r, node in enumerate(self.rank_nodes) if node == here)
        if not stall.enabled:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        config = self.config
        watch_cls = self.ray.remote(num_cpus=0, max_restarts=0)(RayNodeWatch)
        for node in sorted(set(self.rank_nodes) - {here}):
            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            self.node_watches[node] = watch_cls.options(
                scheduling_strategy=strategy, **self.options).remote(
                len(self.rank_nodes), config.worker_stall_timeout_s,
                config.worker_stopped_timeout_s)

    def start(self, ctx: WorkerContext, broadcast_handle: Handle | None,
              queues: ActorQueues | None) -> RayWorkerHandle:
        """One actor in bundle ``ctx.local_rank``; it is not started until its
        ``start()`` returns (``executor._wait_started``)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=ctx.local_rank)
        stall = self.stall
        watch = self.node_watches.get(self.rank_nodes[ctx.local_rank])
        heartbeat: Any = None
        if watch is not None:
            heartbeat = watch.heartbeat.remote()  # Ray resolves it before the constructor
        elif stall is not None:
            heartbeat = stall.ref()
        actor = self.actor_cls.options(scheduling_strategy=strategy, **self.options).remote(
            ctx, broadcast_handle, os.getpid(), queues, os.getpriority(os.PRIO_PROCESS, 0),
            heartbeat, 1.0 if stall is None else stall.beat_s)
        handle = RayWorkerHandle(self.ray, ctx.rank, actor, self.session.node_id,
                                 self.remote_lag_s)
        self.handles.append(handle)
        return handle

    def watch_deaths(self) -> None:
        """The actors' death watch: each actor's liveness ref resolving (it
        died, its node was lost) becomes its handle's death descriptor, which
        the lifecycle's monitor polls with everything else; a node watch's
        verdict (``watch``) marks the actor stalled first."""
        ray, stop, handles = self.ray, self._stop, list(self.handles)
        by_ref: dict[Any, Callable[[Any], None]] = {
            h.liveness: partial(_actor_gone, h) for h in handles}
        for node, node_watch in self.node_watches.items():
            workers = {cell: (h.rank, h.pid) for cell, h in enumerate(handles)
                       if self.rank_nodes[cell] == node and h.pid is not None}
            by_ref[node_watch.watch_workers.remote(workers)] = partial(_stall_seen, ray,
                                                                       handles)

        def watch() -> None:
            while by_ref and not stop.is_set():
                ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=_WATCH_SLICE_S)
                for ref in ready:
                    by_ref.pop(ref)(ref)

        self._watcher = threading.Thread(target=watch, daemon=True, name="RayDeathWatch")
        self._watcher.start()

    def close(self) -> None:
        """After the lifecycle's teardown: stop the death watch, kill the watch
        actors (and wait, bounded, for Ray to have them dead)."""
        self._stop.set()
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(2 * _WATCH_SLICE_S + 5.0)
        watches, self.node_watches = list(self.node_watches.values()), {}
        for watch in watches:
            try:
                self.ray.kill(watch, no_restart=True)
            except Exception:
                logger.debug("ray.kill(a node's stall watch) failed", exc_info=True)
        # A call to a killed actor fails once Ray has it dead.
        ends = [watch.heartbeat.remote() for watch in watches]
        if ends:
            self.ray.wait(ends, num_returns=len(ends), timeout=_WATCH_END_S)


def _actor_gone(handle: RayWorkerHandle, ref: Any) -> None:
    handle.gone()


def _stall_seen(ray: Any, handles: list[RayWorkerHandle], ref: Any) -> None:
    """A node watch's call returned: the verdict on one of its actors, if any."""
    try:
        stall = ray.get(ref, timeout=0)
    except Exception:  # the watch died with its node: the actors' liveness refs tell
        logger.debug("a Ray node's stall watch ended", exc_info=True)
        return
    if isinstance(stall, Stall):
        handles[stall.index].stalled(stall)


__all__ = ["RayActorLauncher", "RayWorkerHandle"]
