"""Continuous batching: which tokens of which requests run in the next step.

::

    add_request ──> waiting (FIFO; preempted requests go back to the front)
                       │ admitted while the token budget, max_num_seqs and
                       │ free KV blocks allow (first chunk of the prompt)
                       ▼
                    running ──> finished (EOS / stop token / max_tokens /
                       ▲   │               max_model_len / abort)
                       └───┘ preempted by recompute when blocks run out

``schedule()`` builds one :class:`~mpexec.outputs.SchedulerOutput`:

1. running requests first, in arrival order: each gets the tokens it has
   not computed yet (a prompt chunk, or the last sampled token), up to what
   is left of ``max_num_batched_tokens``; a long prompt is split over
   steps (chunked prefill) and a chunk that does not end the prompt does
   not sample.  When the KV blocks for a request are not free, the request
   at the end of the running queue is preempted (its blocks freed, its id
   put in ``finished_req_ids`` so workers forget it, and it waits again,
   later resent as new with prompt + the tokens generated so far);
2. then waiting requests, unless this step preempted one.  With prefix
   caching a request first looks up the longest run of cached full blocks
   naming its first tokens (at most all but its last token, whose logits
   it needs): those blocks are shared, ``num_computed_tokens`` starts past
   them, and only the rest is computed.

KV connector (``kv_transfer_config``): past the prefix cache's hits, the
connector may offer more of the prefix from outside (host memory, disk).
Such a request gets blocks for it and waits (``WAITING_FOR_REMOTE_KVS``)
for one step in which the workers load them; it runs once every worker
reported the load, or, if one could not, frees those blocks and recomputes
(:mod:`mpexec.engine.kv_loads` keeps the loads in flight).
Each step carries the connector's metadata (loads, saves) to the workers.

Every full block a step schedules is registered in the prefix cache (by
its hash, :mod:`mpexec.engine.prefix_cache`) once the step is built, so a
request admitted in a later step can share it; a block whose tokens are
not all known yet (a placeholder) waits.  Finished and preempted requests
release their blocks to the cache (LRU), not to oblivion.

``update_from_output()`` takes the step's
:class:`~mpexec.outputs.ModelRunnerOutput`, appends each sampled token and
checks the stop conditions.

Speculative decoding (``num_speculative_tokens`` k > 0): after each step
the engine hands the workers' draft tokens to :meth:`update_draft_token_ids`;
a request that decodes next runs its last token and up to k drafts (KV
slots and budget for all of them), and the step returns the accepted drafts
plus one token.  ``update_from_output`` appends them one by one, checking
the stop conditions after each (the rest of the run is dropped), then rolls
the rejected tail back: ``num_computed_tokens`` loses the rejected drafts,
and blocks that held only them are freed (the next step tells the workers,
``truncated_block_tables``); the stale slots in a kept block are
overwritten by the next step.  A request that may carry drafts waits for
its step's tokens before its next step (its next position depends on how
many were accepted), so it never runs on a placeholder.  Requests with
penalties or structured output never carry drafts.

Pipeline parallelism: the engine passes ``max_requests`` so that the
requests are spread over the micro-batches in flight (one per stage).

Async scheduling (``allow_placeholders``): a step may be scheduled before the
previous step's tokens are back.  A decoding request then gets
``PLACEHOLDER_TOKEN_ID`` as its input token, and the worker substitutes the
token it sampled itself.  Without placeholders (PP > 1: steps in flight at
once must hold disjoint requests) a request with a step in flight is
skipped.  The tokens are the same either way.  Blocks freed by a request
that a step in flight still uses are safe to reuse: every worker runs steps
in order, so the old step is done with them before the next one starts.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mpexec.engine.block_manager import BlockManager, blocks_for
from mpexec.engine.kv_loads import KVLoads
from mpexec.engine.prefix_cache import extend_hashes, root_hash
from mpexec.engine.request import FinishReason, Request, RequestStatus
from mpexec.models.kv_connector import (
    KVConnectorBase,
    KVConnectorRole,
    KVTransferConfig,
    create_connector,
)
from mpexec.models.split_rule import split_from
from mpexec.outputs import (
    PLACEHOLDER_TOKEN_ID,
    DraftTokenIds,
    LogprobsRow,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    """What bounds one step and one request."""

    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    # Share the KV of full blocks between requests with the same prefix.
    enable_prefix_caching: bool = True
    # What the KV depends on besides the tokens (model, dtype): blocks of
    # engines with different namespaces never match.
    prefix_cache_namespace: str = ""
    # The KV connector's settings (KVTransferConfig.to_dict()); None: no connector.
    kv_transfer_config: dict[str, Any] | None = None
    # Speculative decoding: the most draft tokens a request runs in a step (0: off).
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0; got {k!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2; got {self.max_model_len}")


@dataclass
class _Scheduled:
    """A request's part in one step: does the step sample its next token, and
    which drafts does it verify?"""

    request: Request
    samples: bool
    drafts: list[int] = field(default_factory=list)


@dataclass
class SpecDecodeStats:
    """How the drafts fared: per step that carried drafts for a request, the
    drafts run and accepted; ``accepted_per_position[i]`` counts the times the
    (i+1)-th draft was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else None

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1


class Scheduler:
    """Waiting and running queues over one :class:`BlockManager`."""

    def __init__(self, limits: SchedulerLimits, num_blocks: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.limits = limits
        self.blocks = BlockManager(num_blocks, limits.block_size,
                                   enable_caching=limits.enable_prefix_caching)
        self._root_hash = root_hash(limits.prefix_cache_namespace)
        self.connector: KVConnectorBase | None = None
        self.loads: KVLoads | None = None  # the connector's loads (WAITING_FOR_REMOTE_KVS)
        if limits.kv_transfer_config is not None:
            self.connector = create_connector(KVTransferConfig(**limits.kv_transfer_config),
                                              KVConnectorRole.SCHEDULER)
            self.blocks.on_allocate = self.connector.blocks_allocated
            self.loads = KVLoads(self.connector, self.blocks, limits.block_size)
        # blocks are named when they can be shared or a connector stores them
        self._hashing = limits.enable_prefix_caching or self.connector is not None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._forget: set[str] = set()  # finished_req_ids of the next step
        self._next_step = 0
        self._in_flight: dict[int, list[_Scheduled]] = {}
        self.num_preemptions = 0
        self.num_output_tokens = 0  # appended to requests' outputs, all steps
        self.spec_stats = SpecDecodeStats()
        self._cut_tables: dict[str, int] = {}  # truncated_block_tables of the next step

    # -- requests in and out ---------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request``; ValueError if it could never run."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if prompt_len >= self.limits.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens; the context holds "
                f"{self.limits.max_model_len} (max_model_len), prompt and output together")
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def abort_request(self, req_id: str) -> Request | None:
        request = self.requests.get(req_id)
        if request is None:
            return None
        self._finish(request, FinishReason.ABORT)
        return request

    def abort_all(self) -> list[Request]:
        """Finish every request with ABORT (the engine failed or shuts down)."""
        aborted = list(self.requests.values())
        for request in aborted:
            self._finish(request, FinishReason.ABORT)
        return aborted

    def hand_over(self) -> None:
        """Forget every request without finishing it: its engine failed and they
        go on elsewhere (``DataParallelEngine`` re-queues them).  A shutdown
        after this aborts nothing, so the teardown of the failed replica cannot
        finish a request another replica now runs."""
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        if self.loads is not None:
            self.loads.loading.clear()
        self._in_flight.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    def sampling_requests(self, step: int) -> list[Request]:
        """The requests that sample in ``step`` (scheduled, not yet applied)."""
        return [item.request for item in self._in_flight[step] if item.samples]

    # -- one step ----------------------------------------------------------------

    def schedule(self, allow_placeholders: bool = True,
                 max_requests: int | None = None) -> SchedulerOutput | None:
        """The next step, or None when no request has a token to run now.

        ``max_requests`` caps the requests in this step (the engine splits the
        requests over the micro-batches of a pipeline).
        """
        step = self._next_step
        budget = self.limits.max_num_batched_tokens
        room = max_requests if max_requests is not None else self.limits.max_num_seqs
        output = SchedulerOutput(step=step)
        batch: list[_Scheduled] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0 and len(batch) < room:
            request = self.running[index]
            count = self._tokens_to_run(request, budget, allow_placeholders)
            if count == 0:
                index += 1
                continue
            drafts = self._drafts_to_run(request, count, budget)
            needed = self.blocks.blocks_needed(
                len(request.block_ids), request.num_computed_tokens + count + len(drafts))
            while not self.blocks.can_allocate(needed):
                # The last running request has not been scheduled in this step
                # (requests before `index` have); it may be `request` itself.
                self._preempt(self.running[-1], step)
                preempted = True
                if request.status is not RequestStatus.RUNNING:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            new_blocks = self.blocks.allocate(request.req_id, needed)
            request.block_ids.extend(new_blocks)
            if request.needs_new_data:  # admitted through a KV load: new to the workers
                request.needs_new_data = False
                output.scheduled_new_reqs.append(self._new_request_data(request))
            elif new_blocks:
                output.new_block_ids[request.req_id] = new_blocks
            batch.append(self._place(output, request, count, drafts))
            budget -= count + len(drafts)
            index += 1

        loading = self.loads.loading if self.loads is not None else {}
        while (not preempted and self.waiting and budget > 0 and len(batch) < room
               and len(self.running) + len(loading) < self.limits.max_num_seqs):
            request = self.waiting[0]
            hits = self._cached_prefix(request)
            num_cached = len(hits) * self.limits.block_size
            external = self.loads.offered(request, num_cached) if self.loads is not None else 0
            if external:
                assert self.loads is not None
                if not self.loads.start(request, hits, external):
                    break
                self.waiting.popleft()
                continue
            count = min(request.num_tokens - num_cached, budget)
            needed = blocks_for(num_cached + count, self.limits.block_size) - len(hits)
            if not self.blocks.can_allocate(needed + self.blocks.num_unheld(hits)):
                break
            self.waiting.popleft()
            self.blocks.take(request.req_id, hits)
            request.block_ids = hits + self.blocks.allocate(request.req_id, needed)
            request.num_computed_tokens = num_cached
            request.num_cached_blocks = len(hits)
            request.num_cached_tokens = num_cached
            if self.blocks.enable_caching:
                self.blocks.stats.queries += request.num_tokens
                self.blocks.stats.hits += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled_new_reqs.append(self._new_request_data(request))
            batch.append(self._place(output, request, count))
            budget -= count

        # a step for the connector alone: work to send, or (nothing else in
        # flight) loads whose completion only the workers' replies can tell
        connector_work = self.connector is not None and (
            self.connector.has_pending_work() or (bool(loading) and not self._in_flight))
        if not batch and not connector_work:
            return None
        for item in batch:
            self._cache_full_blocks(item.request, computed=True)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        output.finished_req_ids, self._forget = self._forget, set()
        output.truncated_block_tables, self._cut_tables = self._cut_tables, {}
        self._in_flight[step] = batch
        self._next_step += 1
        return output

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(req_id=request.req_id, prompt_token_ids=request.all_token_ids,
                              sampling_params=request.sampling_params,
                              block_ids=list(request.block_ids),
                              num_prompt_tokens=len(request.prompt_token_ids),
                              min_tokens_stop_ids=self._min_tokens_stop_ids(request))

    def _min_tokens_stop_ids(self, request: Request) -> list[int]:
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        return list(dict.fromkeys([*eos, *params.stop_token_ids]))


    # -- KV connector -------------------------------------------------------------------

    def _finish_loads(self, kv: Any) -> None:
        """Loads every worker finished: run the request, or recompute what failed."""
        assert self.loads is not None
        ready, failed = self.loads.finish(kv)
        for request in ready:
            self._cache_full_blocks(request)  # the loaded blocks join the prefix cache
            request.status = RequestStatus.RUNNING
            request.needs_new_data = True
            self.running.append(request)
        for request in failed:
            self.waiting.appendleft(request)

    # -- prefix cache -----------------------------------------------------------------

    def _cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks holding ``request``'s first tokens (never its last token).

        A request that wants prompt logprobs computes its whole prompt (the
        logits of cached positions are not kept), as it does with a connector.
        """
        if not self._hashing or request.sampling_params.prompt_logprobs is not None:
            return []
        usable = (request.num_tokens - 1) // self.limits.block_size
        hashes = request.block_hashes
        if len(hashes) < usable:
            extend_hashes(hashes, request.all_token_ids[:usable * self.limits.block_size],
                          self.limits.block_size, self._root_hash,
                          split_from(len(request.prompt_token_ids)))
        return self.blocks.find_cached(hashes[:usable])

    def _cache_full_blocks(self, request: Request, computed: bool = False) -> None:
        """Register the request's full blocks whose KV is scheduled and tokens known.

        ``computed``: the blocks are the request's own work, held by it while
        this step runs, so the connector may save them after the forward.
        """
        if not self._hashing:
            return
        size = self.limits.block_size
        full = min(request.num_computed_tokens, request.num_tokens, len(request.block_ids) * size) \
            // size
        if full <= request.num_cached_blocks:
            return
        if len(request.block_hashes) < full:
            extend_hashes(request.block_hashes, request.all_token_ids[:full * size], size,
                          self._root_hash, split_from(len(request.prompt_token_ids)))
        for index in range(request.num_cached_blocks, full):
            self.blocks.cache(request.block_ids[index], request.block_hashes[index])
        if computed and self.connector is not None:
            self.connector.blocks_computed(
                list(zip(request.block_ids[request.num_cached_blocks:full],
                         request.block_hashes[request.num_cached_blocks:full], strict=True)))
        request.num_cached_blocks = full

    def _tokens_to_run(self, request: Request, budget: int, allow_placeholders: bool) -> int:
        # A structured-output request's next allowed tokens depend on the token
        # in flight, so it never runs on a placeholder; nor does one that may
        # carry drafts (its next position depends on how many are accepted).
        if request.num_steps_in_flight and (
                not allow_placeholders or request.sampling_params.guided_decoding is not None
                or self._speculates(request)):
            return 0
        total = request.num_tokens_with_placeholders
        outputs = len(request.output_token_ids) + request.num_output_placeholders
        if outputs >= request.sampling_params.max_tokens or total >= self.limits.max_model_len:
            return 0  # its last token is being sampled; it finishes when that arrives
        return min(total - request.num_computed_tokens, budget)

    def _speculates(self, request: Request) -> bool:
        """Whether the request may carry drafts (penalties count every token
        one at a time; a grammar's mask depends on the tokens before it)."""
        params = request.sampling_params
        return (self.limits.num_speculative_tokens > 0 and not params.has_penalties
                and params.guided_decoding is None)

    def _drafts_to_run(self, request: Request, count: int, budget: int) -> list[int]:
        """The drafts ``request`` runs now: only behind its one decode token,
        and no more than the budget, the context and ``max_tokens`` leave room for."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or count != 1 or request.num_output_placeholders \
                or request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = min(self.limits.num_speculative_tokens, budget - 1,
                   self.limits.max_model_len - request.num_tokens,
                   request.sampling_params.max_tokens - len(request.output_token_ids) - 1)
        return drafts[:max(room, 0)]

    def update_draft_token_ids(self, step: int, drafts: DraftTokenIds) -> None:
        """Drafts the workers proposed after ``step``, for each request's next step."""
        for req_id, tokens in zip(drafts.req_ids, drafts.draft_token_ids, strict=True):
            request = self.requests.get(req_id)
            if (request is not None and request.status is RequestStatus.RUNNING
                    and request.epoch_step <= step and self._speculates(request)):
                request.spec_token_ids = list(tokens[:self.limits.num_speculative_tokens])

    def _place(self, output: SchedulerOutput, request: Request, count: int,
               drafts: list[int] | None = None) -> _Scheduled:
        drafts = drafts or []
        start = request.num_computed_tokens
        tokens = []
        for position in range(start, start + count):
            token = request.token_at(position)
            tokens.append(PLACEHOLDER_TOKEN_ID if token is None else token)
        if drafts:
            tokens.extend(drafts)
            output.scheduled_spec_decode_tokens[request.req_id] = list(drafts)
        output.scheduled_tokens[request.req_id] = tokens
        output.num_computed_tokens[request.req_id] = start
        request.num_computed_tokens += count + len(drafts)
        request.num_steps_in_flight += 1
        samples = request.num_computed_tokens - len(drafts) \
            == request.num_tokens_with_placeholders
        if samples:
            request.num_output_placeholders += 1
        return _Scheduled(request, samples, drafts)

    def _roll_back(self, request: Request, drafts: list[int], accepted: int) -> None:
        """Forget the KV of the rejected drafts; free the blocks that held only them."""
        self.spec_stats.record(len(drafts), accepted)
        request.num_computed_tokens -= len(drafts) - accepted
        keep = blocks_for(request.num_computed_tokens, self.limits.block_size)
        if len(request.block_ids) > keep:
            self.blocks.free(request.req_id, request.block_ids[keep:])
            del request.block_ids[keep:]
            self._cut_tables[request.req_id] = keep

    def _preempt(self, request: Request, step: int) -> None:
        logger.debug("preempting %s (recompute): KV blocks ran out", request.req_id)
        self.running.remove(request)
        self._release_blocks(request)
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.needs_new_data = False
        request.spec_token_ids = []
        self._cut_tables.pop(request.req_id, None)
        request.status = RequestStatus.WAITING
        request.epoch_step = step  # outputs of earlier steps no longer count
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._forget.add(request.req_id)

    # -- results -------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           output: ModelRunnerOutput | None) -> list[Request]:
        """Apply one step's sampled tokens; the requests that changed, in batch order."""
        batch = self._in_flight.pop(scheduler_output.step)
        kv = output.kv_connector_output if output is not None else None
        if self.loads is not None and kv is not None:
            self._finish_loads(kv)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[LogprobsRow]] = {}
        prompt_logprobs: dict[str, tuple[int, list[LogprobsRow]]] = {}
        if output is not None:
            for i, req_id in enumerate(output.req_ids):
                tokens = output.sampled_token_ids[i]
                if tokens:
                    sampled[req_id] = tokens
                rows = output.logprobs[i] if output.logprobs is not None else None
                if rows is not None:
                    logprobs[req_id] = rows
            prompt_logprobs = output.prompt_logprobs
        now = time.monotonic()
        changed = []
        for item in batch:
            request = item.request
            request.num_steps_in_flight -= 1
            if request.req_id in prompt_logprobs:
                _add_prompt_logprobs(request, *prompt_logprobs[request.req_id])
            if not item.samples or request.is_finished \
                    or request.epoch_step > scheduler_output.step:
                continue
            request.num_output_placeholders -= 1
            emitted = sampled.get(request.req_id)
            if not emitted or len(emitted) > len(item.drafts) + 1:
                raise RuntimeError(
                    f"step {scheduler_output.step}: the workers returned {emitted or 'no token'} "
                    f"for {request.req_id}, which was due to sample 1 to "
                    f"{len(item.drafts) + 1} tokens")
            if item.drafts:  # before a stop frees the blocks: the rejected KV is never cached
                self._roll_back(request, item.drafts, len(emitted) - 1)
            if request.first_token_time is None:
                request.first_token_time = now
            rows = logprobs.get(request.req_id)
            for index, token in enumerate(emitted):
                request.output_token_ids.append(token)
                self.num_output_tokens += 1
                if rows is not None:
                    request.output_logprobs.append(rows[index])
                    request.cumulative_logprob += rows[index].logprob
                reason = self._stop_reason(request, token)
                if reason is not None:  # the rest of an accepted run is dropped
                    self._finish(request, reason)
                    break
            changed.append(request)
        return changed

    def fail_step(self, scheduler_output: SchedulerOutput,
                  error: BaseException) -> list[Request]:
        """The workers refused this step (and did not run it): who fails, who recomputes.

        The requests that joined in it fail with ``error`` (finish "abort");
        so do all of its requests when none joined.  The others are
        preempted: they recompute from their tokens so far, with the same
        result.  The workers may not have seen the step's
        ``finished_req_ids``: they are sent again.  The failed requests, in
        batch order.
        """
        batch = self._in_flight.pop(scheduler_output.step, [])
        self._forget |= set(scheduler_output.finished_req_ids)
        for req_id, length in scheduler_output.truncated_block_tables.items():
            self._cut_tables.setdefault(req_id, length)
        joined = {new.req_id for new in scheduler_output.scheduled_new_reqs}
        failed = []
        for item in batch:
            request = item.request
            request.num_steps_in_flight -= 1
            if request.is_finished:
                continue
            if not joined or request.req_id in joined:
                request.error = error
                self._finish(request, FinishReason.ABORT)
                failed.append(request)
            elif request.status is RequestStatus.RUNNING:
                self._preempt(request, self._next_step)
        return failed

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if len(request.output_token_ids) > params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                request.stop_reason = token
                return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None

    def _release_blocks(self, request: Request) -> None:
        self._cache_full_blocks(request)
        self.blocks.free(request.req_id, request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0

    def finish_request(self, req_id: str, reason: FinishReason,
                       stop_reason: int | str | None = None) -> Request | None:
        """End a request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(req_id)
        if request is None:
            return None
        request.stop_reason = stop_reason
        self._finish(request, reason)
        return request

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if self.connector is not None and not request.is_finished:
            self.connector.request_finished(request, list(request.block_ids))
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_blocks(request)
            self._forget.add(request.req_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert self.loads is not None
            self.loads.drop(request)
            self._forget.add(request.req_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        self.requests.pop(request.req_id, None)


def _add_prompt_logprobs(request: Request, first_position: int, rows: list[LogprobsRow]) -> None:
    """Append the rows that continue the request's prompt logprobs (a chunk
    recomputed after a preemption repeats rows already there)."""
    have = len(request.prompt_logprobs) + 1  # position of the next row wanted
    skip = have - first_position
    if 0 <= skip < len(rows):
        request.prompt_logprobs.extend(rows[skip:])
