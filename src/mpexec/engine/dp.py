"""Data-parallel replicas behind one front end.

::

    add_request ──► least-loaded live replica (fewest unfinished requests, then
                    fewest tokens still to compute; ties: lowest DP rank)
    step()      ──► every replica with work steps at once (one thread each,
                    each blocking on its own executor), the changed requests
                    of all of them returned together
                    replica 0: Engine ── executor ── TP x PP workers, KV cache
                    replica 1: Engine ── executor ── TP x PP workers, KV cache

Each replica is a whole :class:`Engine` (scheduler, KV cache, executor) with
its own workers; the replicas share nothing, so a request's tokens do not
depend on which replica runs it (greedy, or seeded: the worker's noise is
keyed by the request id and position, and the front end names every
request, ``req-N``, before it picks the replica).

Failover (``restart=True``): when a replica fails (a worker died or hung
past the executor's stall bounds, a collective failed, its health check
failed), its unfinished requests are taken back before the engine aborts
them, reset as a preempted request is (blocks and computed tokens
forgotten, the tokens generated so far kept) and queued on the least-loaded
surviving replica, which recomputes their prefix and continues; the dead
replica is shut down and, once that is done (its processes and ports
released), rebuilt by the factory in a background thread, and when that
fails again after a backoff (``backoff_s``, doubling,
up to ``max_restarts`` in a row).  With no live replica the requests wait for the rebuilt one.  The
unit that fails and restarts is one replica, or with lockstep every replica
(they share one expert-parallel world: a rank cannot rejoin alone, so the
survivors are taken down with it and the group is rebuilt and joined
again).  ``stats`` counts failures, restarts and re-queued requests, and
``failover.timeline`` stamps each phase; every event is logged.  Without
failover the first failure is the caller's error, as with one engine (with
lockstep the failure of the rank that died or hung, not its peers' broken
collectives).  A replica may live on other nodes (its executor here has no
local worker); what rebuilding it means is the factory's: for ``LLM``, a
new executor that waits for the lost node to join again.  ``shutdown()``
does not wait that out: the factory gets the engine's closing event as the
executors' start-up cancel (``Executor.start``), so a rebuild still waiting
gives up and cleans up at once.

The data parallel group of dense replicas with failover (``dp_group``):
each replica keeps a world of its own, and the DP group is formed outside
them by generation (``mpexec.models.dp_world``).  Generation 0 forms here on
construction; when a replica fails, the next ``step`` retires the group on
the survivors (their DP collectives then raise ``StaleGroupError``), and
once every replica serves again it forms the next generation over all of
them, survivors included.  Both happen at the start of a step, from the
thread that steps, so no survivor is in a step or a collective of its own
world.  A replica that fails during the join (dies, or freezes and is named
by its executor's stall watch) is failed over like one that fails a step;
a join that fails otherwise is tried again once the replicas change.
``dp_group_generation`` is the generation that holds (None: none does).

Lockstep (``lockstep=True``, experts split across the replicas): every MoE
layer's collectives span all replicas, so each step runs one forward on
every replica: the busy ones step, the idle ones run
``execute_dummy_batch`` (one token into the scratch block), and when no
replica has work nobody steps.  The engines must be synchronous (one
forward per step) and single-stage.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mpexec.engine.engine import Engine, EngineDeadError, EngineStats
from mpexec.engine.request import FinishReason, Request, RequestStatus
from mpexec.errors import WorkerDiedError, root_failure
from mpexec.outputs import SamplingParams

logger = logging.getLogger(__name__)

# A failed replica's shutdown is bounded by its executor's grace and term
# steps; the rebuild waits at most this long for it.
_TEARDOWN_WAIT_S = 60.0


@dataclass
class FailoverStats:
    failures: int = 0
    restarts: int = 0
    requeued_requests: int = 0
    # (DP rank, seconds from the failure to the rebuilt replica taking work)
    recovery_s: list[tuple[int, float]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    # (monotonic time, DP ranks, phase): "failed" (seen by the front end),
    # "rebuilding" (the factory called), "serving" (the rebuilt replica takes work)
    timeline: list[tuple[float, tuple[int, ...], str]] = field(default_factory=list)


@dataclass(frozen=True)
class DpGroupSpec:
    """Where the detached DP group's stores listen (a port per generation, picked
    here) and how long its forming and its collectives may wait."""

    host: str
    timeout_s: float


class DataParallelEngine:
    """``len(replicas)`` engines behind the API of one (see the module docstring)."""

    def __init__(self, replicas: list[Engine], *, restart: bool = False,
                 factory: Callable[[list[int], threading.Event], list[Engine]] | None = None,
                 max_restarts: int = 3, backoff_s: float = 1.0, lockstep: bool = False,
                 dp_group: DpGroupSpec | None = None) -> None:
        """``factory(ranks, cancel)`` rebuilds the replicas of those DP ranks
        (with lockstep: all of them, joined into one world again); once
        ``cancel`` is set (this engine shuts down) it should give up, cleaned
        up, as soon as it can.  ``dp_group``: the replicas' workers have a
        detached DP group (``join_dp_group``), formed here and after every
        rebuild (module docstring); a first generation that does not form is
        the constructor's error."""
        if not replicas:
            raise ValueError("a data parallel engine needs at least one replica")
        if restart and factory is None:
            raise ValueError("restart=True needs a factory that rebuilds a replica")
        # Replicas that share collectives (experts split across them) step
        # together: one forward each per step, an idle one a dummy batch.
        self.lockstep = lockstep
        self.dummy_steps = 0
        self.replicas: list[Engine | None] = list(replicas)
        self.restart = restart
        self.factory = factory
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.failover = FailoverStats()
        self.error: BaseException | None = None
        self.limits = replicas[0].limits
        self.num_blocks = sum(e.num_blocks for e in replicas)  # KV blocks of all replicas
        # one request builder for every replica, the rebuilt ones too (a
        # request waiting for a replica is built here; a constraint compiles once)
        self.builder = replicas[0].builder
        for engine in replicas:
            engine.builder = self.builder
        self._dead_listeners: list[Callable[[], None]] = []
        self._owner: dict[str, int] = {}
        self._orphans: list[Request] = []  # waiting for a live replica
        self._next_id = 0
        self._lock = threading.Lock()  # replicas[] and _orphans against the rebuilders
        # keyed by the unit that fails and restarts together (see _unit)
        self._rebuilding: dict[tuple[int, ...], threading.Thread] = {}
        self._failed_at: dict[tuple[int, ...], float] = {}
        self._attempts: dict[tuple[int, ...], int] = {}
        self._teardowns: dict[int, threading.Thread] = {}  # DP rank -> its shutdown
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=len(replicas),
                                        thread_name_prefix="mpexec-dp-step")
        self.dp_group = dp_group
        self.dp_group_generation: int | None = None  # the generation that holds
        self._dp_next_generation = 0
        # the replicas the generation spans, and those last tried (the engines
        # themselves, compared by identity: a rebuilt replica is a new engine)
        self._dp_members: list[tuple[int, Engine]] = []
        self._dp_tried: list[tuple[int, Engine]] = []
        if dp_group is not None:
            failures = self._form_dp_group(self._live())
            if failures:
                self._pool.shutdown(wait=False)
                raise root_failure([exc for _, exc in sorted(failures.items())])

    # -- the Engine API ------------------------------------------------------------

    @property
    def executor(self) -> Any:
        """The first live replica's executor (for callers that show one)."""
        live = self._live()
        return live[0][1].executor if live else None

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters summed."""
        total = EngineStats()
        for _, engine in self._live():
            for name in ("steps", "scheduled_tokens", "sampled_tokens", "spec_num_drafts",
                         "spec_draft_tokens", "spec_accepted_tokens"):
                setattr(total, name, getattr(total, name) + getattr(engine.stats, name))
            per_position = engine.stats.spec_accepted_per_position
            total.spec_accepted_per_position = [
                a + b for a, b in itertools.zip_longest(total.spec_accepted_per_position,
                                                        per_position, fillvalue=0)]
            total.sync_step_s += engine.stats.sync_step_s
            total.sync_worker_s += engine.stats.sync_worker_s
            total.sync_step_total_s += engine.stats.sync_step_total_s
            total.sync_worker_total_s += engine.stats.sync_worker_total_s
        return total

    @property
    def scheduler(self) -> _Schedulers:
        """The live replicas' queues and free blocks together (for load metrics)."""
        return _Schedulers([e.scheduler for _, e in self._live()])

    def add_dead_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` when a replica's executor reports a failure (with
        ``restart`` the next ``step`` then fails it over: an idle engine loop
        woken by it steps once for that, ``has_unfinished_requests``)."""
        self._dead_listeners.append(listener)
        for _, engine in self._live():
            engine.add_dead_listener(listener)

    @property
    def is_dead(self) -> bool:
        if self.error is not None:
            return True
        return not self.restart and any(e.is_dead for _, e in self._live())

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    req_id: str | None = None, arrival_time: float | None = None,
                    grammar: Any = None) -> Request:
        self._raise_if_dead()
        if req_id is None:
            req_id = f"req-{self._next_id}"
            self._next_id += 1
        live = [(rank, e) for rank, e in self._live() if not e.is_dead]
        if not live:
            # every replica is being rebuilt: the request waits for the first one back
            request = self.builder.build(prompt_token_ids, params, req_id, arrival_time,
                                         grammar)
            with self._lock:
                self._orphans.append(request)
            return request
        rank, engine = min(live, key=lambda item: (*_load(item[1]), item[0]))
        request = engine.add_request(prompt_token_ids, params, req_id=req_id,
                                     arrival_time=arrival_time, grammar=grammar)
        self._owner[req_id] = rank
        return request

    def abort_request(self, req_id: str) -> Request | None:
        with self._lock:
            for request in self._orphans:
                if request.req_id == req_id:
                    self._orphans.remove(request)
                    request.status = RequestStatus.FINISHED
                    request.finish_reason = FinishReason.ABORT
                    return request
        rank = self._owner.pop(req_id, None)
        engine = self.replicas[rank] if rank is not None else None
        return engine.abort_request(req_id) if engine is not None else None

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work: requests to finish, or (``restart``) a
        replica that failed while idle, which the next step fails over, so a
        loop woken by the dead listener rebuilds it without waiting for a
        request."""
        return bool(self._orphans) or any(
            e.has_unfinished_requests() or (self.restart and e.is_dead)
            for _, e in self._live())

    def step(self) -> list[Request]:
        """Step every replica with work at once; the requests that changed."""
        self._raise_if_dead()
        if self.restart:  # a replica whose worker died while it was idle
            dead: list[tuple[int, Engine, list[Request], BaseException]] = [
                (rank, e, [], e.error or RuntimeError(
                    "its executor reported a worker failure"))
                for rank, e in self._live() if e.is_dead and not e.has_unfinished_requests()]
            if dead:
                self._fail_over(dead)
        if self.dp_group is not None:
            self._sync_dp_group()
        self._adopt_orphans()
        busy = [(rank, e) for rank, e in self._live() if e.has_unfinished_requests()]
        if not busy:
            if self._orphans or self._rebuilding:
                time.sleep(0.05)  # waiting for a rebuilt replica: not a busy loop
            return []
        # What each replica holds now, to take back if it fails during the step.
        held = {rank: [r for r in e.scheduler.requests.values() if not r.is_finished]
                for rank, e in busy}
        futures: list[tuple[int, Engine, Future[list[Request]]]] = [
            (rank, e, self._pool.submit(e.step)) for rank, e in busy]
        if self.lockstep:  # the idle replicas meet the busy ones' collectives
            idle = [(rank, e) for rank, e in self._live() if (rank, e) not in busy]
            self.dummy_steps += len(idle)
            futures += [(rank, e, self._pool.submit(_dummy_step, e)) for rank, e in idle]
        changed: list[Request] = []
        failed: list[tuple[int, Engine, list[Request], BaseException]] = []
        for rank, engine, future in futures:
            try:
                changed += future.result()
            except BaseException as exc:
                failed.append((rank, engine, held.get(rank, []), exc))
        if failed and not self.restart:
            self.error = root_failure([exc for *_, exc in failed])
            raise self.error
        if failed:
            self._fail_over(failed)
        for request in changed:
            if request.is_finished:
                self._owner.pop(request.req_id, None)
        return changed

    def shutdown(self) -> None:
        self._closed.set()  # a rebuild still starting gives up (the factory's cancel)
        for thread in list(self._rebuilding.values()):
            thread.join(timeout=_TEARDOWN_WAIT_S)
        self._pool.shutdown(wait=True)
        for _, engine in self._live():
            engine.shutdown()
        with self._lock:
            for request in self._orphans:
                request.status = RequestStatus.FINISHED
                request.finish_reason = FinishReason.ABORT
            self._orphans.clear()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # -- failover ------------------------------------------------------------------

    def _live(self) -> list[tuple[int, Engine]]:
        with self._lock:
            return [(rank, e) for rank, e in enumerate(self.replicas) if e is not None]

    def _unit(self, rank: int) -> tuple[int, ...]:
        """The DP ranks that fail and restart with ``rank``: all of them in lockstep."""
        return tuple(range(len(self.replicas))) if self.lockstep else (rank,)

    def _fail_over(self, failed: list[tuple[int, Engine, list[Request], BaseException]]
                   ) -> None:
        """Take back the failed replicas' requests (``held``: what each held when
        its step began), and in lockstep every other replica's too; requeue them,
        shut those replicas down and rebuild them."""
        now = time.monotonic()
        down: list[tuple[int, Engine, list[Request]]] = []
        for rank, engine, held, exc in failed:
            self.failover.failures += 1
            self._note(f"DP rank {rank} failed ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''})")
            down.append((rank, engine, [r for r in held if not r.is_finished or (
                r.finish_reason is FinishReason.ABORT and r.error is not None)]))
        if self.lockstep:
            taken = {rank for rank, *_ in down}
            for rank, engine in self._live():
                if rank in taken:
                    continue
                # a healthy member of the group: its requests come back unfinished
                pending = [r for r in engine.scheduler.requests.values() if not r.is_finished]
                engine.scheduler.abort_all()
                down.append((rank, engine, pending))
                self._note(f"DP rank {rank} is taken down with its expert parallel group")
        units: set[tuple[int, ...]] = set()
        moved: list[Request] = []
        with self._lock:
            for rank, engine, requests in down:
                # the teardown below must not abort what moves to the survivors
                engine.scheduler.hand_over()
                self.replicas[rank] = None
                moved += requests
                units.add(self._unit(rank))
        for request in moved:
            _reset_for_recompute(request)
        self.failover.requeued_requests += len(moved)
        self._note(f"re-queueing {len(moved)} request(s) of DP rank(s) "
                   f"{sorted(rank for rank, *_ in down)}")
        with self._lock:
            self._orphans.extend(moved)
        for rank, engine, _ in down:
            teardown = threading.Thread(target=engine.shutdown, daemon=True,
                                        name=f"mpexec-dp{rank}-teardown")
            self._teardowns[rank] = teardown
            teardown.start()
        for unit in sorted(units):
            self._failed_at[unit] = now
            self.failover.timeline.append((now, unit, "failed"))
            self._start_rebuild(unit)
        self._adopt_orphans()

    def _adopt_orphans(self) -> None:
        with self._lock:
            if not self._orphans:
                return
            orphans, self._orphans = self._orphans, []
        for request in orphans:
            live = [(rank, e) for rank, e in self._live() if not e.is_dead]
            if not live:
                with self._lock:
                    self._orphans.append(request)
                continue
            rank, engine = min(live, key=lambda item: (*_load(item[1]), item[0]))
            request.epoch_step = 0  # every step of the new scheduler counts for it
            engine.scheduler.add_request(request)
            self._owner[request.req_id] = rank

    def _start_rebuild(self, unit: tuple[int, ...]) -> None:
        name = _ranks(unit)
        attempts = self._attempts.get(unit, 0)
        if attempts >= self.max_restarts:
            self._note(f"{name}: {attempts} restarts failed; left down")
            if not self._live():
                self.error = RuntimeError(f"every data parallel replica is down ({name} "
                                          f"failed {attempts} restarts)")
            return
        self._attempts[unit] = attempts + 1
        # The first restart starts at once (the failure is already behind it);
        # the backoff only spaces out restarts that failed in turn.
        delay = 0.0 if attempts == 0 else self.backoff_s * (2 ** (attempts - 1))
        thread = threading.Thread(target=self._rebuild, args=(unit, delay),
                                  name=f"mpexec-dp{unit[0]}-restart", daemon=True)
        self._rebuilding[unit] = thread
        thread.start()

    def _rebuild(self, unit: tuple[int, ...], delay: float) -> None:
        assert self.factory is not None
        name = _ranks(unit)
        if self._closed.wait(delay):
            return
        # What the old replica held (its processes, its node channel's port)
        # is released before the new one asks for it again.
        until = time.monotonic() + _TEARDOWN_WAIT_S
        for rank in unit:
            teardown = self._teardowns.get(rank)
            while (teardown is not None and teardown.is_alive() and not self._closed.is_set()
                   and time.monotonic() < until):
                teardown.join(0.05)
        if self._closed.is_set():
            return
        self.failover.timeline.append((time.monotonic(), unit, "rebuilding"))
        try:
            engines = self.factory(list(unit), self._closed)
        except BaseException as exc:
            self._note(f"{name}: restart failed ({type(exc).__name__}: {exc})")
            self._rebuilding.pop(unit, None)
            if not self._closed.is_set():
                self._start_rebuild(unit)
            return
        if self._closed.is_set():
            for engine in engines:
                engine.shutdown()
            return
        for engine in engines:
            engine.builder = self.builder
            for listener in self._dead_listeners:
                engine.add_dead_listener(listener)
        with self._lock:
            for rank, engine in zip(unit, engines, strict=True):
                self.replicas[rank] = engine
        now = time.monotonic()
        self.failover.timeline.append((now, unit, "serving"))
        self._rebuilding.pop(unit, None)
        self._attempts[unit] = 0
        self.failover.restarts += 1
        elapsed = now - self._failed_at.get(unit, now)
        self.failover.recovery_s += [(rank, elapsed) for rank in unit]
        self._note(f"{name} restarted and serving again {elapsed:.1f} s after its failure")

    # -- the detached data parallel group --------------------------------------------

    def _sync_dp_group(self) -> None:
        """Between steps: retire the DP group on the survivors of a failure; form
        the next generation once every replica serves (module docstring)."""
        live = self._live()
        if self.dp_group_generation is not None:
            if _same_members(live, self._dp_members):
                return
            retired = self.dp_group_generation
            self.dp_group_generation = None
            self._dp_call(live, "retire_dp_group",
                          (retired + 1, f"a member failed: DP rank(s) "
                           f"{sorted(set(range(len(self.replicas))) - {r for r, _ in live})}"))
            self._note(f"DP group generation {retired} retired on DP rank(s) "
                       f"{[rank for rank, _ in live]}")
        if len(live) < len(self.replicas) or _same_members(live, self._dp_tried):
            return
        failures = self._form_dp_group(live)
        died = [(rank, engine, [r for r in engine.scheduler.requests.values()
                                if not r.is_finished], failures[rank])
                for rank, engine in live
                if rank in failures and (engine.is_dead or isinstance(failures[rank],
                                                                        WorkerDiedError))]
        if died:
            self._fail_over(died)

    def _form_dp_group(self, live: list[tuple[int, Engine]]) -> dict[int, BaseException]:
        """Form the next generation over ``live`` (every replica); the ranks whose
        join failed, with their errors."""
        from mpexec.executor.spec import PortReservation

        assert self.dp_group is not None
        generation = self._dp_next_generation
        self._dp_next_generation += 1
        self._dp_tried = list(live)
        port = PortReservation(self.dp_group.host, 0)
        try:
            failures = self._dp_call(live, "join_dp_group", (
                self.dp_group.host, port.port, generation, self.dp_group.timeout_s))
        finally:
            port.close()
        ranks = [rank for rank, _ in live]
        if failures:
            self._note(f"DP group generation {generation} did not form over DP ranks {ranks}: "
                       + "; ".join(f"DP rank {rank}: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}"
                                   for rank, exc in sorted(failures.items())))
            return failures
        self.dp_group_generation = generation
        self._dp_members = list(live)
        logger.info("DP group generation %d formed over DP ranks %s", generation, ranks)
        return {}

    def _dp_call(self, live: list[tuple[int, Engine]], method: str,
                 args: tuple[Any, ...]) -> dict[int, BaseException]:
        """``method`` on every live replica's workers at once; the failures by rank.
        Bounded: the workers' own waits are (``timeout_s``), and so is this one."""
        assert self.dp_group is not None
        bound = 2 * self.dp_group.timeout_s + 5.0
        futures = [(rank, engine.executor.collective_rpc(method, args=args, non_block=True,
                                                          timeout=bound))
                   for rank, engine in live]
        failures: dict[int, BaseException] = {}
        for rank, future in futures:
            try:
                future.result(timeout=bound + 5.0)
            except Exception as exc:
                failures[rank] = exc
        return failures

    def _note(self, message: str) -> None:
        self.failover.events.append(message)
        logger.warning("%s", message)

    def _raise_if_dead(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error}") from self.error


@dataclass
class _FreeBlocks:
    num_free_blocks: int


class _Schedulers:
    """``running``, ``waiting`` and ``blocks.num_free_blocks`` over several schedulers."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.running = [r for s in schedulers for r in s.running]
        self.waiting = [r for s in schedulers for r in s.waiting]
        self.blocks = _FreeBlocks(sum(s.blocks.num_free_blocks for s in schedulers))


def _ranks(unit: tuple[int, ...]) -> str:
    return f"DP rank {unit[0]}" if len(unit) == 1 else f"DP ranks {list(unit)}"


def _same_members(a: list[tuple[int, Engine]], b: list[tuple[int, Engine]]) -> bool:
    """The same DP ranks held by the very same engines."""
    return len(a) == len(b) and all(ra == rb and ea is eb
                                    for (ra, ea), (rb, eb) in zip(a, b, strict=True))


def _dummy_step(engine: Engine) -> list[Request]:
    engine.executor.execute_dummy_batch()
    return []


def _load(engine: Engine) -> tuple[int, int]:
    """(unfinished requests, tokens still to compute) of one replica."""
    requests = list(engine.scheduler.requests.values())
    return len(requests), sum(r.num_tokens - r.num_computed_tokens for r in requests)


def _reset_for_recompute(request: Request) -> None:
    """Back to a waiting request that keeps its tokens, as a preemption leaves it."""
    request.status = RequestStatus.WAITING
    request.finish_reason = None
    request.error = None
    request.finish_time = None
    request.num_computed_tokens = 0
    request.num_output_placeholders = 0
    request.num_steps_in_flight = 0
    request.block_ids = []
    request.num_cached_blocks = 0  # of the dead replica's cache (block_hashes stay valid)
    request.num_cached_tokens = 0
    request.num_external_tokens = 0
    request.skip_kv_load = False
    request.needs_new_data = False
    request.num_preemptions += 1
