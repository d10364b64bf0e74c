"""RayExecutor: the same executor, its workers Ray actors in a placement group.

::

    driver (RayExecutor)                          actor r (actor.RayWorkerActor)
    --------------------                          ----------------------------------
    RaySession.open, place_workers (cluster)
    RayActorLauncher (launcher):
    actor r created in bundle r  ------------->   start(): worker_cls(context), init_device,
                                                  load_model (+ queues on the "shm" path)
    wait_exit() in group "supervise" ------->     blocks while the actor lives
    death watch: ray.wait(liveness refs)          (resolves with an error when it dies)
      -> the handle's death pipe -> the lifecycle's monitor (as for a pidfd)
    stall watch (``stall``): the driver's own     Heartbeat thread: cell r of the
      for the actors on its Ray node; a watch       segment of whoever watches its
      actor on each other node (``watch``),         node, from the constructor on
      whose verdict the death watch hears

Calls travel one of two ways (``ExecutorConfig.ray_call_path``):

``"shm"`` (default)
    Ray only places and supervises the actors; calls are broadcast through
    mpexec's shared-memory ring and replies come back on each actor's reply
    queue, exactly as for worker processes (``serve()`` runs WorkerProc's
    busy loop).  Actors on the driver's Ray node read shared memory, actors
    on other Ray nodes the same queues over the network (remote readers,
    authenticated with a per-executor secret; see ``queues``).
``"ray"``
    each call is one ``actor.execute.remote(call)`` per actor (the call
    ``ray.put`` once when there are several actors) and each reply is read
    with ``ray.get`` (``replies``); works wherever the actors are.

Either way the calls in flight are the same ``CallOrder`` as for
MultiprocExecutor (only the reply reader differs), so ordering, deadlines,
``non_block`` futures, typed ``WorkerError`` and stats are the same code
(``driver.Driver``); and the actors are ``WatchedWorker``s of the same
``Lifecycle``, so failure and teardown follow the same table.  A dead actor
(killed, its node lost, raised in start-up) is seen by the death watch (its
liveness ref fails: the handle's death descriptor becomes readable and the
lifecycle's one monitor fails the executor) or by a reader (``ray.get``
fails, or its queue closes): the executor fails once, every call gets
``WorkerDiedError`` naming the rank and the node, and the failure callbacks
run once.  An actor that is stopped (SIGSTOP) or hung - Ray still sees it
alive - is named by the stall watch within ``worker_stopped_timeout_s`` /
``worker_stall_timeout_s``: it is killed and every call gets
``WorkerStalledError`` naming its rank.  ``shutdown()``: the workers' own
shutdown (bounded by ``shutdown_grace_s``), then the lifecycle's teardown
(``ray.kill`` every actor: ``terminate``, never a pipe closing), the
launcher's watches stop, the placement group is removed, and Ray is
stopped if this executor started it.

``RayExecutor(config, cancel=event)``: each wait of the start (the
placement group, the actors' ``start()``, the queue handshake) looks at
``event`` every 50 ms (1.5 s in the handshake); once it is set the start
raises ``WorkerStartupError`` and the same teardown ends what it started.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.errors import QueueClosedError, WorkerStartupError
from mpexec.executor.driver import Driver
from mpexec.executor.futures import ReplyReader
from mpexec.executor.handshake import handshake
from mpexec.executor.lifecycle import Lifecycle, State
from mpexec.executor.ray.cluster import (
    RaySession,
    actor_runtime_env,
    bundle_nodes,
    bundles_for,
    place_workers,
    remove_group,
)
from mpexec.executor.ray.launcher import RayActorLauncher, RayWorkerHandle
from mpexec.executor.ray.queues import broadcast_queue, plan_queues, reply_queue
from mpexec.executor.ray.replies import RayReplies
from mpexec.executor.spec import PortReservation, worker_contexts
from mpexec.executor.stall import StallWatch

logger = logging.getLogger(__name__)
# How often a start-up wait looks at the start's cancel event.
_TICK_S = 0.05


class RayExecutor(Driver):
    """The executor interface on Ray; see the module docstring."""

    supports_pp = True
    uses_ray = True

    # The "ray" call path's reply reader (``_reply_reader``), else None.
    ray_replies: RayReplies | None = None

    def __init__(self, config: ExecutorConfig, monitor_workers: bool | None = None, *,
                 cancel: threading.Event | None = None) -> None:
        super().__init__(config, monitor_workers, cancel=cancel)
        self.call_path = config.ray_call_path
        self.session: RaySession | None = None
        self.placement_group: Any = None
        self.actors: list[RayWorkerHandle] = []
        self._ray_state = _RayState(config)

    def _reply_reader(self) -> ReplyReader:
        """On the "ray" call path each reply is one ``ray.get`` (``replies``)."""
        if self.config.ray_call_path != "ray":
            return super()._reply_reader()
        self.ray_replies = RayReplies(self)
        return self.ray_replies

    def _closer(self) -> Callable[[], None]:
        """The lifecycle's close, and what Ray holds (placement group, a Ray
        this executor started)."""
        return partial(_close, self.lifecycle, self._ray_state)

    def _start_workers(self, deadline: float) -> None:
        config, life, state = self.config, self.lifecycle, self._ray_state
        if self.parallel_config.nnodes_within_dp > 1:
            raise NotImplementedError("executor_backend 'ray' places workers on nodes itself: "
                                      "leave nnodes at 1 (per data parallel rank)")
        if config.shared_worker_lock:
            raise ValueError("shared_worker_lock is not available with executor_backend 'ray'")
        tick = self.raise_if_start_cancelled  # every wait below gives up when cancelled
        tick()
        session = self.session = state.session = RaySession.open(config.ray_address)
        ray = session.ray
        group = self.placement_group = state.group = place_workers(
            session, bundles_for(self.world_size, config.device_type),
            config.ray_placement_strategy, config.ray_placement_timeout_s, tick, _TICK_S)
        life.port = PortReservation(self.parallel_config.master_addr,
                                    self.parallel_config.master_port)
        rank_nodes = bundle_nodes(ray, group, self.world_size)
        life.stall = StallWatch(self.world_size, config.worker_stall_timeout_s,
                                config.worker_stopped_timeout_s)
        handle = plan = None
        if self.call_path == "shm":
            plan = plan_queues(ray, group, session.node_id, self.world_size, config)
            mq = self.rpc_broadcast_mq = broadcast_queue(config, plan)
            life.queues.append(mq)
            handle = mq.export_handle()
        # The driver's code directories, so that its worker class imports there too.
        runtime_env = actor_runtime_env(session)
        launcher = state.launcher = RayActorLauncher(session, group, rank_nodes, config,
                                                     runtime_env)
        # The stall watch runs where the actors are: the driver's for its
        # own Ray node, a watch actor's for each other one (``watch``).
        launcher.watch_stalls(life.stall)
        handles = self.actors
        for ctx in worker_contexts(config, life.port.init_method):
            handles.append(launcher.start(
                ctx, handle, None if plan is None else plan.for_rank(ctx.rank)))
            life.handles.append(handles[-1])
        reply_handles = _wait_started(ray, handles, deadline, config.startup_timeout_s,
                                      runtime_env, tick)
        tick()
        if plan is None:
            assert self.ray_replies is not None
            self.ray_replies.attach(ray, handles)
            launcher.watch_deaths()
            life.start_monitor()
            return
        for h in handles:
            if h.node_id != plan.rank_nodes[h.rank]:  # Ray broke the bundle's pinning
                raise WorkerStartupError(
                    f"worker rank {h.rank} runs on node {h.node_id}, not on its bundle's "
                    f"node {plan.rank_nodes[h.rank]}", rank=h.rank)
        for reply_handle in reply_handles:
            reply_mq = reply_queue(config, plan, reply_handle)
            self.response_mqs.append(reply_mq)
            life.queues.append(reply_mq)
        self.replies.attach(self.response_mqs, self.calls.lock)
        state.serve_refs = [h.actor.serve.remote() for h in handles]
        assert self.rpc_broadcast_mq is not None
        # A remote reader cannot see its peer die: the death watch, already, can.
        launcher.watch_deaths()
        life.start_monitor()
        # the handshake's ``lost``: nothing is lost, but a cancel raises
        handshake(self.rpc_broadcast_mq, self.response_mqs, deadline, config.startup_timeout_s,
                  lost=tick, explain_closed=life.handshake_failure)

    # -- failure ------------------------------------------------------------------

    @property
    def death_verdict_s(self) -> float:
        """Actors on several Ray nodes: as long as for multi-node mp's nodes."""
        session = self.session
        if session is None or all(h.node_id in ("?", session.node_id) for h in self.actors):
            return super().death_verdict_s
        config = self.config
        return config.node_timeout_s + 2 * config.node_heartbeat_s

    def _closed_error(self, rank: int | None, exc: QueueClosedError) -> Exception:
        life = self.lifecycle
        if life.state in (State.READY, State.STARTING):
            handle: Any = self._dead_worker(rank, exc)
            if handle is not None:
                life.worker_gone(handle)
        return life.closed_error()

    # -- calls ----------------------------------------------------------------------

    def _broadcast(self, message: tuple[Any, ...], deadline: float | None, name: str) -> None:
        if self.call_path == "shm":
            super()._broadcast(message, deadline, name)
            return
        assert self.ray_replies is not None
        self.ray_replies.submit(message)


def _wait_started(ray: Any, handles: list[RayWorkerHandle], deadline: float,
                  timeout_s: float, runtime_env: dict[str, Any] | None = None,
                  tick: Callable[[], None] = lambda: None) -> list[Any]:
    """Each actor's ``start()``: its reply handle (None on the "ray" path), in rank
    order; ``tick()`` (which may raise: the start was cancelled) every ``_TICK_S``."""
    pending = {h.actor.start.remote(): h for h in handles}
    started: dict[int, Any] = {}
    while pending:
        tick()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = ", ".join(str(h.rank) for h in pending.values())
            raise WorkerStartupError(f"worker rank(s) {late} did not report READY within "
                                     f"{timeout_s:g}s (startup_timeout_s)")
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, _TICK_S))
        for ref in done:
            h = pending.pop(ref)
            try:
                h.pid, h.node_id, started[h.rank] = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                error = WorkerStartupError(
                    f"worker rank {h.rank} failed during start-up with "
                    f"{type(cause).__name__}: {cause}{_import_hint(exc, runtime_env)}",
                    rank=h.rank, remote_traceback=str(exc))
                error.__cause__ = cause
                raise error from None
            except ray.exceptions.RayError as exc:
                raise WorkerStartupError(f"worker rank {h.rank} died during start-up: "
                                         f"{h.why_gone()}{_import_hint(exc, runtime_env)}",
                                         rank=h.rank) from exc
    return [started[h.rank] for h in handles]


def _import_hint(exc: BaseException, runtime_env: dict[str, Any] | None) -> str:
    """When the actor could not import a module: which one, and where it looked."""
    missing = _missing_module(exc)
    if missing is None:
        return ""
    import importlib.util

    try:
        spec = importlib.util.find_spec(missing)
    except (ImportError, ValueError):
        spec = None
    here = (f"; in the driver it is {spec.origin}" if spec is not None and spec.origin
            else "; the driver cannot import it either")
    env_vars = (runtime_env or {}).get("env_vars", {})
    tried = env_vars.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    paths = [p for p in tried.split(os.pathsep) if p]
    return (f" (module {missing!r} is not importable in the Ray actor{here}; the actor "
            f"looked in its working directory, its installed packages and PYTHONPATH "
            f"{paths}: install the module, or put its directory on PYTHONPATH on every "
            "Ray node)")


def _missing_module(exc: BaseException) -> str | None:
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain Ray builds is short
        if seen is None:
            break
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            return seen.name
        seen = getattr(seen, "cause", None) or seen.__cause__
    match = re.search(r"No module named '([^']+)'", str(exc))
    return match.group(1) if match else None


class _RayState:
    """What the finalizer ends besides the lifecycle (no executor reference)."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.call_path = config.ray_call_path
        self.grace_s = config.shutdown_grace_s
        self.session: RaySession | None = None
        self.group: Any = None
        self.serve_refs: list[Any] = []
        self.launcher: RayActorLauncher | None = None

    def end_workers_gently(self, life: Lifecycle) -> None:
        """Let every worker run its own shutdown(), within the grace period."""
        assert self.session is not None
        ray = self.session.ray
        if self.call_path == "shm":
            for mq in life.queues[:1]:
                mq.shutdown()  # the broadcast queue: each serve() leaves its loop
            refs = self.serve_refs
        else:
            refs = [h.actor.shutdown_worker.remote() for h in life.handles]  # type: ignore
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.grace_s)

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.close()
        if self.group is not None:
            remove_group(self.group)
            self.group = None
        if self.session is not None:
            self.session.close()


def _close(life: Lifecycle, state: _RayState) -> None:
    if os.getpid() != life.owner_pid:
        return
    if life.begin_close():
        try:
            state.end_workers_gently(life)
        except Exception:
            logger.debug("the workers' own shutdown failed", exc_info=True)
    life.close()
    state.close()


__all__ = ["RayExecutor"]
