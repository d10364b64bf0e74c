"""One request as the scheduler sees it: its tokens, its progress, its end.

A request's token sequence is ``prompt_token_ids + output_token_ids``; the
KV cache holds the first ``num_computed_tokens`` of them (counting tokens
that a step in flight is computing).  With async scheduling a step may be
scheduled before the previous step's sampled tokens are back: each such
token is counted in ``num_output_placeholders`` until its value arrives, so
the scheduler knows how long the sequence *will* be::

    prompt ........ output ..... placeholders
    |<------- num_tokens ------->|<-- k -->|
    |<--- num_computed_tokens --------->|       (KV written or being written)

``epoch_step`` is the first step whose outputs count for this request: a
preempted request forgets its KV cache, and the outputs of steps scheduled
before its preemption are dropped (it recomputes them, and a request's
tokens depend only on its own tokens and seed, so they come out the same).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import Any

from mpexec.outputs import LogprobsRow, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # a KV connector loads its prefix
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended; the values are what ``RequestOutput.finish_reason`` shows."""

    STOP = "stop"  # EOS, one of the stop token ids or a stop string
    LENGTH = "length"  # max_tokens, or the context (max_model_len) is full
    ABORT = "abort"  # the caller aborted it, or the engine failed


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # one row per output token when sampling_params.logprobs is not None
    output_logprobs: list[LogprobsRow] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # rows for prompt positions 1.. (position 0 has none), with prompt_logprobs
    prompt_logprobs: list[LogprobsRow] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # the stop string or stop token id that ended it (None: EOS, length, abort)
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    # Steps scheduled with this request whose outputs have not been processed.
    num_steps_in_flight: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Prefix cache: the hashes of the request's full blocks of known tokens
    # (computed as needed), how many of ``block_ids`` are registered in (or
    # came from) the cache, and the prompt tokens the cache served.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = 0
    # KV connector: tokens loaded from outside; a failed load means recompute.
    num_external_tokens: int = 0
    skip_kv_load: bool = False
    # Admitted through a KV load: the workers get its NewRequestData when it first runs.
    needs_new_data: bool = False
    # Speculative decoding: draft tokens proposed after its last step, for its next one.
    spec_token_ids: list[int] = field(default_factory=list)
    epoch_step: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Set when the engine failed while the request was pending.
    error: BaseException | None = None
    finish_time: float | None = None
    # the engine's per-request helpers: stop-string text (engine.stop_strings)
    # and the structured-output automaton (engine.structured)
    stop_text: Any = None
    grammar: Any = None
    # LLM's vLLM-shaped logprob dicts built so far (a stream builds each once)
    logprob_dicts: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens known to the driver: prompt plus sampled outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, position: int) -> int | None:
        """The token at ``position``, or None while it is still being sampled."""
        prompt_len = len(self.prompt_token_ids)
        if position < prompt_len:
            return self.prompt_token_ids[position]
        if position < self.num_tokens:
            return self.output_token_ids[position - prompt_len]
        return None


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The engine requests of one prompt: ``params.n`` of them, each with ``n=1``;
    with a seed, completion ``i`` uses ``seed + i`` (its own noise stream)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams; got {type(params).__name__}")
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]
