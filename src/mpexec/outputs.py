"""What travels between the scheduler, the executor and the workers.

These types are deliberately small and torch-free: an engine fills them with
whatever it needs (token ids as lists, tensors as numpy arrays or torch CPU
tensors in ``extra``); the executor only broadcasts them and merges the KV
transfer information of the replies (:class:`KVOutputAggregator`).
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple


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


MAX_LOGPROBS = 20
"""The most top-k entries ``logprobs`` and ``prompt_logprobs`` may ask for."""

MIN_TEMPERATURE = 0.01
"""A temperature in (0, this) is taken as this (vLLM's rule): the sampler
divides float32 logits by it, and 1e-300 reads as 0 there (every logit
infinite, every probability NaN, token 0 picked whatever the model said)."""

MIN_TOP_P = 1e-6
"""A ``top_p`` in (0, this) is taken as this, for the same float32 reason
(a 0 nucleus drops every token); it keeps the most likely token either way."""

REPETITION_PENALTY_RANGE = (1e-30, 1e30)
"""Where ``repetition_penalty`` must lie: outside it float32 reads it as 0 or
infinity and the penalised logits become NaN."""

LOGIT_BIAS_BOUND = 100.0
"""Each ``logit_bias`` value is clipped to [-this, this] (OpenAI's range, and
vLLM's clip): a bias of 1e308 is infinite in float32 and makes NaN."""


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Constrain a request's output to a JSON schema, a regular expression or
    one string out of a list (exactly one of the three).

    The engine compiles it (with ``outlines-core``, the ``serve`` extra) into
    an automaton over the model's vocabulary and sends, with every step, the
    tokens the automaton allows next.  ``whitespace_pattern`` replaces the
    regex that JSON output may put between tokens (default: at most one space).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("guided_decoding needs exactly one of json, regex or choice; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"guided_decoding.json must be a JSON schema (dict or str); "
                             f"got {type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"guided_decoding.regex must be a string; got {self.regex!r}")
        if self.regex is not None:
            try:  # the grammar library's syntax is a subset: caught early, caught cheaply
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"guided_decoding.regex is not a valid regular expression: "
                                 f"{exc}") from None
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"guided_decoding.json is not valid JSON: {exc}") from None
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("guided_decoding.choice must be a non-empty list of non-empty "
                             f"strings; got {self.choice!r}")


@dataclass
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    The field names and meanings are vLLM's.  ``temperature == 0`` is greedy;
    a temperature in (0, ``MIN_TEMPERATURE``) is raised to it, a ``top_p``
    in (0, ``MIN_TOP_P``) likewise.  ``top_k`` is -1 or 0 (off) or a count
    >= 1; ``top_p == 1`` and ``min_p == 0`` switch those filters off.
    A request's tokens depend only on its own tokens so far, its parameters
    and ``seed`` (None: the engine's seed), never on what else is in the batch.

    - ``n`` completions per prompt; with a ``seed``, completion ``i`` uses
      ``seed + i``.
    - ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]) subtract from
      the logit of every token already in the *output*, once / once per
      occurrence; ``repetition_penalty`` (in ``REPETITION_PENALTY_RANGE``,
      1 = off) divides a positive logit (multiplies a negative one) of every
      token in the prompt or the output; ``logit_bias`` adds to the logits of
      the given token ids (each bias clipped to [-100, 100]).
    - ``stop``: strings that end the output (not included in the text unless
      ``include_stop_str_in_output``); ``stop_token_ids`` end it too.  No stop
      (EOS, stop token or stop string) counts before ``min_tokens`` tokens.
    - ``logprobs``: None, or the number k of most likely tokens returned per
      output position besides the sampled one (0: the sampled one only);
      ``prompt_logprobs`` likewise for the prompt tokens.  ``True`` means 0.
    - ``guided_decoding``: a :class:`GuidedDecodingParams` constraint.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a single string is accepted too
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number; got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1]; got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]; got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be > 0, in [{low:g}, {high:g}]; "
                             f"got {self.repetition_penalty}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError("top_k must be -1 or 0 (no top-k) or an integer >= 1; "
                             f"got {self.top_k!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1; got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens="
                             f"{self.max_tokens}]; got {self.min_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None; got {self.seed!r}")
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        self.stop = _stop_strings(self.stop)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # the older boolean form: the sampled token only
                value = 0 if value else None
                setattr(self, name, value)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}]; "
                                 f"got {value!r}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.guided_decoding, dict):
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
        if self.guided_decoding is not None and not isinstance(self.guided_decoding,
                                                               GuidedDecodingParams):
            raise ValueError("guided_decoding must be a GuidedDecodingParams; got "
                             f"{type(self.guided_decoding).__name__}")
        if self.guided_decoding is not None and self.min_tokens:
            # The constraint may allow nothing but EOS while min_tokens bans it.
            raise ValueError("min_tokens cannot be combined with guided_decoding")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _int_list(name: str, value: object) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be integers (a list of token ids); got {value!r}")
    items = list(value)
    if not all(_is_int(t) and t >= 0 for t in items):
        raise ValueError(f"{name} must be integers >= 0; got {items!r}")
    return items


def _stop_strings(value: object) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop must be a string or a list of non-empty strings; got {value!r}")
    return list(items)


def _logit_bias(value: object) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias; got {value!r}")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0); got {key!r}")
        if not _is_number(amount) or not math.isfinite(amount):
            raise ValueError(f"logit_bias[{key!r}] must be a finite number; got {amount!r}")
        bias[token] = min(LOGIT_BIAS_BOUND, max(-LOGIT_BIAS_BOUND, float(amount)))
    return bias or None


class LogprobsRow(NamedTuple):
    """Log-probabilities at one position: the chosen token's and the top k.

    ``rank`` is 1 + the number of tokens more likely than ``token_id``.
    """

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


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
    # how many of prompt_token_ids are the prompt (None: all; fewer when a
    # preempted request comes back with its outputs so far)
    num_prompt_tokens: int | None = None
    # token ids the sampler must not pick while the output is shorter than
    # sampling_params.min_tokens (EOS unless ignore_eos, and stop_token_ids)
    min_tokens_stop_ids: list[int] = field(default_factory=list)


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

    Speculative decoding: ``scheduled_spec_decode_tokens[req_id]`` are draft
    tokens, the last ``len(drafts)`` of ``scheduled_tokens[req_id]``; the step
    samples a token after each of them as well as after the last real token,
    and returns the drafts it accepted plus one token of its own.
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
    # request id -> the draft tokens that end its scheduled_tokens (speculative decoding)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # request id -> the length its block table is cut to before new_block_ids are
    # appended (blocks that held only rejected drafts were freed)
    truncated_block_tables: dict[str, int] = field(default_factory=dict)
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
    """The result of one step: the tokens of each request that sampled.

    ``req_ids`` lists the requests that sampled in this step, in batch
    order; ``sampled_token_ids[i]`` holds the token(s) of ``req_ids[i]``
    (one, or with speculative decoding the accepted drafts and one more)
    and ``logprobs[i]`` the log-probabilities of those tokens, one row per
    token, when the request asked for them (None otherwise).  ``prompt_logprobs[req_id]`` is
    ``(position, rows)``: the rows score the prompt tokens at ``position``
    onwards (a prefill chunk of a request with ``prompt_logprobs``).
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[LogprobsRow] | None] | None = None
    prompt_logprobs: dict[str, tuple[int, list[LogprobsRow]]] = field(default_factory=dict)
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
