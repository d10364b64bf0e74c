"""What travels between the scheduler, the executor and the workers.

These types are deliberately small and torch-free: an engine fills them with
whatever it needs (token ids as lists, tensors as numpy arrays or torch CPU
tensors in ``extra``); the executor only broadcasts them and merges the KV
transfer information of the replies (:class:`KVOutputAggregator`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class SchedulerOutput:
    """One scheduling step, broadcast to every worker."""

    step: int = 0
    # request id -> tokens to process for it in this step
    scheduled_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
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
    """KV cache transfer progress reported by one worker (or merged)."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None

    def is_empty(self) -> bool:
        return not self.finished_sending and not self.finished_recving


@dataclass
class ModelRunnerOutput:
    """The result of one step: sampled tokens per request."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
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
        for output in outputs:
            kv = getattr(output, "kv_connector_output", None)
            if kv is None:
                continue
            self._count(kv.finished_sending, self._send_remaining, finished_sending)
            self._count(kv.finished_recving, self._recv_remaining, finished_recving)
        chosen = outputs[output_rank]
        if not isinstance(chosen, ModelRunnerOutput):
            return chosen
        merged = KVConnectorOutput(
            finished_sending=finished_sending or None,
            finished_recving=finished_recving or None,
        )
        return replace(chosen, kv_connector_output=merged)
