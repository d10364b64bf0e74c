"""The engine loop: a :class:`Scheduler` driving any :class:`Executor`.

::

    add_request ─> Scheduler.schedule() ─> SchedulerOutput (step N)
                        │ execute_model(step N)   (forward on every worker)
                        │ sample_tokens(grammar)  (the output rank replies; grammar:
                        │                          bitmasks of constrained requests, or None)
                        ▼
                   ModelRunnerOutput ─> Scheduler.update_from_output()
                                          ─> tokens appended, stops checked
                                          ─> automata advanced, stop strings checked

Synchronous (``async_scheduling`` off): one step at a time, blocking calls.

Async scheduling: both calls go out with ``non_block=True`` and up to
``executor.max_concurrent_batches`` steps are in flight.  ``step()`` first
fills the pipeline (schedules and sends steps while there is room and work),
then waits for the oldest step and applies it.  With PP = 1 the second step
is scheduled while the first runs and its decode inputs are
``PLACEHOLDER_TOKEN_ID``; with PP > 1 every stage gets its own micro-batch
(each with about 1/PP of the requests) and the micro-batches hold disjoint
requests, so no placeholder is sent.

Speculative decoding (``limits.num_speculative_tokens`` > 0): every step
is followed by ``take_draft_token_ids`` (non-blocking with async
scheduling, so it runs on the workers right after the step's sampling); the
drafts reach the scheduler with the step's tokens, for the requests' next
steps.  A stop string found inside a run of several tokens cuts the output
after the token that completed it.

Start-up sizes the KV cache: ``num_blocks`` is the minimum over the workers
of ``determine_available_memory() // kv_cache_block_bytes()`` (and no more
than ``max_num_seqs`` requests of ``max_model_len`` tokens can use), then
every worker gets ``initialize_cache(num_blocks)``; ``max_model_len`` is
capped to what those blocks hold.

Failure: any error out of the executor (``WorkerDiedError`` when a worker
died, ``WorkerError`` when one raised, ``TimeoutError``) marks the engine
dead, finishes every pending request (``finish_reason`` "abort", ``error``
set) and reaches the caller unchanged.  The executor's failure callback
marks the engine dead too, so an engine whose worker died while it was idle
refuses the next call at once; nothing waits forever (the futures of a dead
executor fail at once, and every call has the executor's timeout).

A worker that raised because its peer died (a collective failing:
``CollectiveFailedError``, ``PeerDiedInCollectiveError``, or a
shared-memory channel's ``PeerDiedError``) is a symptom:
before failing with that error the engine gives the executor a bounded
moment to declare the death (``executor.verdict``: ``node_timeout_s`` plus
two heartbeats when workers span several nodes, half a second on one) and,
if it does, fails with the executor's ``WorkerDiedError`` instead, which
names the dead worker or node.  Any other worker error (a ValueError in the
model, say) fails the engine at once.  A queue that closes under a call is
already the executor's ``WorkerDiedError`` (it waits for a remote node's
verdict itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from mpexec.config import ExecutorConfig
from mpexec.engine.admission import RequestBuilder
from mpexec.engine.block_manager import blocks_for
from mpexec.engine.request import FinishReason, Request
from mpexec.engine.scheduler import Scheduler, SchedulerLimits
from mpexec.engine.stop_strings import StopStringText
from mpexec.errors import MpexecError, WorkerError
from mpexec.executor import Executor
from mpexec.executor.verdict import death_behind
from mpexec.outputs import (
    DraftTokenIds,
    GrammarOutput,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class EngineDeadError(MpexecError, RuntimeError):
    """The engine failed earlier (``__cause__`` says why) and takes no more work."""


SYNC_STEP_WINDOW = 4096  # synchronous steps whose timings EngineStats keeps


@dataclass
class EngineStats:
    """Counters of one engine; the executor's share comes from synchronous steps."""

    steps: int = 0
    scheduled_tokens: int = 0
    sampled_tokens: int = 0
    # Speculative decoding: steps' drafts per request, draft tokens run and
    # accepted, and acceptances of the i-th draft of a step.
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # Prefix cache: prompt tokens looked up, and those served from the cache.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Synchronous steps only: driver-side time of execute_model + sample_tokens,
    # and the time the output rank reported inside those two methods, for the
    # last SYNC_STEP_WINDOW steps (a long-running server must not grow them).
    sync_step_s: deque[float] = field(
        default_factory=lambda: deque(maxlen=SYNC_STEP_WINDOW))
    sync_worker_s: deque[float] = field(
        default_factory=lambda: deque(maxlen=SYNC_STEP_WINDOW))
    # Their running sums over every step (a server's metrics read these).
    sync_step_total_s: float = 0.0
    sync_worker_total_s: float = 0.0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted draft tokens per draft token run (None: no drafts yet)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens \
            else None

    @property
    def executor_share(self) -> float | None:
        """Fraction of a step spent outside the workers' methods, over the recent
        window of synchronous steps (None: no sync steps)."""
        total = sum(self.sync_step_s)
        if not total or len(self.sync_worker_s) != len(self.sync_step_s):
            return None
        return max(0.0, total - sum(self.sync_worker_s)) / total


@dataclass
class _InFlight:
    scheduler_output: SchedulerOutput
    executed: Future[Any] | None
    sampled: Future[Any] | None
    result: ModelRunnerOutput | None = None
    drafts: Future[Any] | DraftTokenIds | None = None  # speculative decoding


class Engine:
    """Continuous batching over an executor whose workers speak the model-worker API."""

    def __init__(self, executor: Executor, limits: SchedulerLimits,
                 eos_token_ids: tuple[int, ...] = (), *, tokenizer: Any = None,
                 vocab_size: int | None = None) -> None:
        self.executor = executor
        # For stop strings (decoding) and structured output (the vocabulary).
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # checks and builds requests (a data-parallel front end shares one)
        self.builder = RequestBuilder(tokenizer, vocab_size, self.eos_token_ids)
        self.async_scheduling = executor.scheduler_config.async_scheduling
        if self.async_scheduling and not executor.supports_async_scheduling():
            raise ValueError(
                f"{type(executor).__name__} does not support async scheduling")
        self.max_steps_in_flight = executor.max_concurrent_batches if self.async_scheduling \
            else 1
        self.allow_placeholders = executor.parallel_config.pipeline_parallel_size == 1
        self.speculative = limits.num_speculative_tokens > 0
        self.stats = EngineStats()
        self.error: BaseException | None = None
        self._dead = threading.Event()
        self._in_flight: deque[_InFlight] = deque()
        self._next_id = 0
        self.num_blocks = self._initialize_kv_cache(limits)
        capacity = self.num_blocks * limits.block_size
        if capacity < limits.max_model_len:
            logger.warning("max_model_len %d capped to %d: the KV cache holds %d blocks of %d",
                           limits.max_model_len, capacity, self.num_blocks, limits.block_size)
            limits = replace(limits, max_model_len=capacity)
        self.limits = limits
        self.scheduler = Scheduler(limits, self.num_blocks, eos_token_ids)
        self._dead_listeners: list[Callable[[], None]] = []
        self._dispatching: SchedulerOutput | None = None
        executor.register_failure_callback(self._on_executor_failure)

    @classmethod
    def start(cls, config: ExecutorConfig, limits: SchedulerLimits,
              eos_token_ids: tuple[int, ...] = ()) -> Engine:
        """Build the executor ``config`` names and an engine on it."""
        executor = Executor.get_class(config)(config)
        try:
            return cls(executor, limits, eos_token_ids)
        except BaseException:
            executor.shutdown()
            raise

    def _initialize_kv_cache(self, limits: SchedulerLimits) -> int:
        available = self.executor.collective_rpc("determine_available_memory")
        per_block = self.executor.collective_rpc("kv_cache_block_bytes")
        num_blocks = min(int(a) // max(1, int(b)) for a, b in zip(available, per_block,
                                                                    strict=True))
        # More blocks than max_num_seqs full-length requests can use is memory wasted.
        useful = limits.max_num_seqs * blocks_for(limits.max_model_len, limits.block_size)
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(
                f"no room for a KV cache: the workers offer {min(available)} bytes and "
                f"one block takes {max(per_block)}; give the workers more memory "
                "(kv_cache_memory_bytes) or use more of them")
        self.executor.collective_rpc("initialize_cache", args=(num_blocks,))
        return num_blocks

    # -- requests ----------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    req_id: str | None = None, arrival_time: float | None = None,
                    grammar: Any = None) -> Request:
        """Queue a request; ValueError if it can never run (too long, empty) or
        ``params`` do not fit the model (one request per completion: ``n`` > 1
        is fanned out by the caller, see :func:`~mpexec.engine.request.child_params`).
        ``grammar``: ``builder.compile_guide``'s automaton for its constraint,
        compiled beforehand (else it is compiled here)."""
        self._raise_if_dead()
        if req_id is None:
            req_id = f"req-{self._next_id}"
            self._next_id += 1
        request = self.builder.build(prompt_token_ids, params, req_id, arrival_time, grammar)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, req_id: str) -> Request | None:
        return self.scheduler.abort_request(req_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def is_dead(self) -> bool:
        return self._dead.is_set()

    def add_dead_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (from any thread) when the executor reports a failure."""
        self._dead_listeners.append(listener)
        if self._dead.is_set():
            listener()

    def _on_executor_failure(self) -> None:
        self._dead.set()
        for listener in list(self._dead_listeners):
            listener()

    # -- the loop -----------------------------------------------------------------

    def step(self) -> list[Request]:
        """Send what can be sent, apply the oldest step; the requests that changed."""
        self._raise_if_dead()
        try:
            while len(self._in_flight) < self.max_steps_in_flight:
                scheduler_output = self.scheduler.schedule(
                    self.allow_placeholders, self._micro_batch_requests())
                if scheduler_output is None:
                    break
                self._dispatch(scheduler_output)
            if not self._in_flight:
                if self.scheduler.has_unfinished_requests():
                    raise RuntimeError("the scheduler has requests but nothing it can run")
                return []
            return self._complete_oldest()
        except BaseException as exc:
            died = death_behind(self.executor, exc)
            if died is not None:
                self._fail(died)
                raise died from exc
            refused = self._dispatching
            if refused is not None and self._fails_alone(exc):
                # The workers refused this step's input and stay in step:
                # the step's requests fail (or recompute), the rest go on.
                self._dispatching = None
                logger.warning("a step failed in the workers; its requests fail alone: %s",
                               str(exc).splitlines()[0])
                return self.scheduler.fail_step(refused, exc)
            self._fail(exc)
            raise

    def _fails_alone(self, exc: BaseException) -> bool:
        """A worker's ValueError/TypeError in a synchronous step on one pipeline stage.

        Those are the workers' checks of a step's input (token ids, positions),
        raised alike on every rank before any collective, so no rank is left
        waiting in one; with steps in flight or several stages it is not so.
        """
        return (isinstance(exc, WorkerError) and not self.async_scheduling
                and self.allow_placeholders  # PP == 1
                and exc.method in ("execute_model", "sample_tokens")
                and exc.exc_type.rsplit(".", 1)[-1] in ("ValueError", "TypeError")
                and not self.executor.is_failed)

    def _micro_batch_requests(self) -> int | None:
        """With PP micro-batches in flight, each takes its share of the requests."""
        if self.allow_placeholders or self.max_steps_in_flight == 1:
            return None
        unfinished = len(self.scheduler.requests)
        return max(1, -(-unfinished // self.max_steps_in_flight))

    def _grammar(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The allowed-token bitmasks of the constrained requests that sample now."""
        constrained = [r for r in self.scheduler.sampling_requests(scheduler_output.step)
                       if r.grammar is not None]
        if not constrained:
            return None
        return self.builder.structured_outputs().grammar_output(
            [r.req_id for r in constrained], [r.grammar for r in constrained])

    def _dispatch(self, scheduler_output: SchedulerOutput) -> None:
        self.stats.steps += 1
        self.stats.scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        cache_stats = self.scheduler.blocks.stats
        self.stats.prefix_cache_queries = cache_stats.queries
        self.stats.prefix_cache_hits = cache_stats.hits
        grammar = self._grammar(scheduler_output)
        if not self.async_scheduling:
            started = time.perf_counter()
            self._dispatching = scheduler_output
            executed: Any = self.executor.execute_model(scheduler_output)
            sampled: Any = self.executor.sample_tokens(grammar)
            drafts = self.executor.take_draft_token_ids() if self.speculative else None
            self._dispatching = None
            elapsed = time.perf_counter() - started
            result = executed if executed is not None else sampled
            self._record_sync_step(elapsed, result)
            self._in_flight.append(_InFlight(scheduler_output, None, None, result, drafts))
            return
        executed_f: Any = self.executor.execute_model(scheduler_output, non_block=True)
        sampled_f: Any = self.executor.sample_tokens(grammar, non_block=True)
        drafts_f: Any = None
        if self.speculative:
            drafts_f = self.executor.collective_rpc(
                "take_draft_token_ids", unique_reply_rank=self.executor.output_rank,
                non_block=True, timeout=self.executor.config.execute_model_timeout_s)
        self._in_flight.append(_InFlight(scheduler_output, executed_f, sampled_f,
                                         drafts=drafts_f))

    def _record_sync_step(self, elapsed: float, result: Any) -> None:
        extra = getattr(result, "extra", None) or {}
        if "worker_execute_s" in extra:
            worker_s = float(extra["worker_execute_s"]) + float(extra.get("worker_sample_s", 0.0))
            self.stats.sync_step_s.append(elapsed)
            self.stats.sync_worker_s.append(worker_s)
            self.stats.sync_step_total_s += elapsed
            self.stats.sync_worker_total_s += worker_s

    def _complete_oldest(self) -> list[Request]:
        item = self._in_flight[0]
        result = item.result
        drafts = item.drafts
        if item.executed is not None and item.sampled is not None:
            executed = item.executed.result()
            sampled = item.sampled.result()
            result = executed if executed is not None else sampled
            if isinstance(drafts, Future):
                drafts = drafts.result()
        self._in_flight.popleft()
        scheduler = self.scheduler
        changed = scheduler.update_from_output(item.scheduler_output, result)
        if isinstance(drafts, DraftTokenIds):
            scheduler.update_draft_token_ids(item.scheduler_output.step, drafts)
        self._record_outputs()
        for request in changed:
            if request.grammar is not None and not request.is_finished:
                request.grammar.advance(request.output_token_ids[-1], return_tokens=False)
            if request.stop_text is not None:
                self._check_stop_strings(request)
        return changed

    def _record_outputs(self) -> None:
        scheduler = self.scheduler
        self.stats.sampled_tokens = scheduler.num_output_tokens
        spec = scheduler.spec_stats
        self.stats.spec_num_drafts = spec.num_drafts
        self.stats.spec_draft_tokens = spec.num_draft_tokens
        self.stats.spec_accepted_tokens = spec.num_accepted_tokens
        self.stats.spec_accepted_per_position = list(spec.accepted_per_position)

    def _check_stop_strings(self, request: Request) -> None:
        text: StopStringText = request.stop_text
        stop = text.add(request.output_token_ids[text.num_tokens:])
        if stop is None:
            return
        # several tokens arrived at once: those after the one that ended the text go
        del request.output_token_ids[text.num_tokens:]
        for row in request.output_logprobs[text.num_tokens:]:
            request.cumulative_logprob -= row.logprob
        del request.output_logprobs[text.num_tokens:]
        if request.is_finished:  # the same token also hit EOS or max_tokens
            request.finish_reason = FinishReason.STOP
            request.stop_reason = stop
        else:
            self.scheduler.finish_request(request.req_id, FinishReason.STOP, stop)

    # -- failure and end ------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._dead.set()
        self._in_flight.clear()
        for request in self.scheduler.abort_all():
            request.error = exc
        logger.error("engine failed: %s: %s", type(exc).__name__, str(exc).splitlines()[0]
                     if str(exc) else "")

    def _raise_if_dead(self) -> None:
        if not self._dead.is_set():
            return
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error}") from self.error
        # Failed while idle (the executor's failure callback): its first error
        # says which worker and how.
        cause = self.executor.failure
        if cause is not None:
            raise EngineDeadError("the engine failed: its executor reported a worker "
                                  f"failure: {cause}") from cause
        raise EngineDeadError("the engine failed: its executor reported a worker failure")

    def shutdown(self) -> None:
        """Stop the executor (idempotent); pending requests are aborted."""
        self._in_flight.clear()
        self.scheduler.abort_all()
        self.executor.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.close()  # its threads and sockets (KV transfer)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()
