"""What travels between the scheduler, the executor and the workers.

These types are deliberately small and torch-free: an engine fills them with
whatever it needs (token ids as lists, tensors as numpy arrays or torch CPU
tensors in ``extra``); the executor only broadcasts them and merges the KV
transfer information of the replies (:class:`KVOutputAggregator`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

PLACEHOLDER_TOKEN_ID = -1
"""Stands, in ``SchedulerOutput.scheduled_tokens``, for the token that the
request sampled in the step before, which the driver has not seen yet (async
scheduling).  Every rank of the last pipeline stage samples, so each of them
knows it; the engine never sends a placeholder to a pipeline with PP > 1
(micro-batches in flight at once hold disjoint requests)."""


@dataclass
class SamplingParams:
    """How one request picks its next token and when it stops.

    ``temperature == 0`` is greedy.  ``top_k <= 0``, ``top_p == 1`` and
    ``min_p == 0`` switch those filters off.  A request's tokens depend only
    on its own tokens so far, its parameters and ``seed`` (None: the
    engine's seed), never on what else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Return the log-probability of each sampled token.
    logprobs: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number; got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1]; got {self.min_p}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer; got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None; got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) \
                or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers; got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class NewRequestData:
    """A request the workers have not seen (or see again after preemption).

    ``prompt_token_ids`` holds every token known so far: the prompt, plus the
    tokens already generated when a preempted request is resumed (its KV cache
    was dropped and is recomputed).  ``block_ids`` is its block table in the
    paged KV cache.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    """One scheduling step, broadcast to every worker.

    Per scheduled request, ``scheduled_tokens[req_id]`` are the input tokens
    of this step (a chunk of the prompt, or the one last sampled token while
    decoding; see :data:`PLACEHOLDER_TOKEN_ID`), placed at positions
    ``num_computed_tokens[req_id]`` onwards.  A request samples in this step
    when the step brings its computed tokens to at least
    ``len(prompt_token_ids)`` (a partial prefill chunk does not sample).
    Workers keep each request's state (block table, sampling parameters)
    from its ``NewRequestData`` until its id appears in
    ``finished_req_ids`` (finished, aborted or preempted).  The payload stays
    small on purpose: a decoding request ships one token id.
    """

    step: int = 0
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    # request id -> input tokens of this step, in the order the batch runs them
    scheduled_tokens: dict[str, list[int]] = field(default_factory=dict)
    # request id -> position of its first scheduled token
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # request id -> KV blocks appended to its block table this step
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # requests the workers should forget before running this step
    finished_req_ids: set[str] = field(default_factory=set)
    # what the KV connector's workers do this step (loads, saves), if one is configured
    kv_connector_metadata: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.scheduled_tokens.values())


@dataclass
class GrammarOutput:
    """Structured-output constraints for the sampling half of a step."""

    structured_output_request_ids: list[str] = field(default_factory=list)
    # one allowed-token bitmask per constrained request (any array type)
    grammar_bitmask: Any = None


@dataclass
class KVConnectorOutput:
    """KV cache transfer progress reported by one worker (or merged).

    ``invalid_block_ids``: blocks a worker failed to load (merged over the
    workers as a union: one failure spoils the block for all).
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] | None = None

    def is_empty(self) -> bool:
        return not self.finished_sending and not self.finished_recving \
            and not self.invalid_block_ids


@dataclass
class ModelRunnerOutput:
    """The result of one step: one sampled token per request that sampled.

    ``req_ids`` lists the requests that sampled in this step, in batch
    order; ``sampled_token_ids[i]`` holds the token(s) of ``req_ids[i]``
    and ``logprobs[i]`` their log-probabilities when the request asked for
    them (None otherwise).
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float] | None] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class AsyncModelRunnerOutput(ABC):
    """An output whose values are still being produced (e.g. a device copy).

    The worker calls :meth:`get_output` just before sending the reply, on the
    output thread when async scheduling is on, so the copy overlaps the next
    step.
    """

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Block until the output is ready and return it."""


@dataclass
class DraftTokenIds:
    """Draft tokens proposed for speculative decoding."""

    req_ids: list[str] = field(default_factory=list)
    draft_token_ids: list[list[int]] = field(default_factory=list)


class KVOutputAggregator:
    """Merges KV transfer progress over the workers of one step.

    A request has finished sending (or receiving) only once every one of the
    ``expected_finished_count`` workers reported it; until then the workers
    that did report it are remembered across steps.
    """

    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count < 1:
            raise ValueError(
                f"expected_finished_count must be >= 1; got {expected_finished_count}"
            )
        self.expected_finished_count = expected_finished_count
        self._send_remaining: Counter[str] = Counter()
        self._recv_remaining: Counter[str] = Counter()

    def _count(self, reported: set[str] | None, remaining: Counter[str], done: set[str]) -> None:
        for req_id in reported or ():
            if req_id not in remaining:
                remaining[req_id] = self.expected_finished_count
            remaining[req_id] -= 1
            if remaining[req_id] == 0:
                del remaining[req_id]
                done.add(req_id)

    def aggregate(self, outputs: list[Any], output_rank: int = 0) -> Any:
        """The output of ``output_rank``, with KV progress merged over ``outputs``.

        ``outputs`` holds one reply per worker (a :class:`ModelRunnerOutput`
        or None).  The returned output is a copy; the inputs are not changed.
        """
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        invalid: set[int] = set()
        for output in outputs:
            kv = getattr(output, "kv_connector_output", None)
            if kv is None:
                continue
            self._count(kv.finished_sending, self._send_remaining, finished_sending)
            self._count(kv.finished_recving, self._recv_remaining, finished_recving)
            invalid.update(kv.invalid_block_ids or ())
        chosen = outputs[output_rank]
        if not isinstance(chosen, ModelRunnerOutput):
            return chosen
        merged = KVConnectorOutput(
            finished_sending=finished_sending or None,
            finished_recving=finished_recving or None,
            invalid_block_ids=invalid or None,
        )
        return replace(chosen, kv_connector_output=merged)
