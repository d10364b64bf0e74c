"""What the offline API hands back: one :class:`RequestOutput` per prompt.

Shaped like vLLM's so that its users feel at home: ``output.outputs[0].text``
works, and so do the shortcuts ``output.text``, ``output.token_ids`` and
``output.finish_reason``.  Times are wall-clock seconds (``time.time()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None

    @property
    def time_to_first_token_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob, the top-k tokens and the chosen one.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the
    # context full), "abort"; None while running
    finish_reason: str | None
    # with SamplingParams.logprobs: one dict per output token
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    # the stop string or stop token id that ended it (None: EOS, length, abort)
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_preemptions: int = 0
    extra: dict[str, object] = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: None for the first prompt token,
    # then one dict per prompt token
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
