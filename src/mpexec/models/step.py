"""What a worker remembers about requests, and how one step's inputs are laid out.

The scheduler tells every worker the same story (:class:`SchedulerOutput`):
new requests arrive with their prompt, sampling parameters and block table;
running ones get more blocks and one token per decode step; finished ones
are forgotten first.  :class:`RequestTable` replays it, and
:meth:`RequestTable.prepare` turns one step into flat token ids and
positions, the KV layout (:class:`~mpexec.models.kv_cache.ScheduledRequest`)
and the rows that sample.

``PLACEHOLDER_TOKEN_ID`` stands for the token this worker sampled in the
step before; every rank of the last pipeline stage samples, so it appends
the token to the request's history in ``sample_tokens`` and finds it here.
Other stages never see a placeholder (the engine does not send one with
PP > 1).  ``new_block_ids`` is applied to requests already known: a request
that is new in this step carries its whole block table in ``block_ids``.

Draft tokens (``scheduled_spec_decode_tokens``) end a request's scheduled
tokens; each of them and the token before it gets a row that samples
(:mod:`mpexec.models.spec_decode` decides what is accepted).  The drafts
join the request's history for this step only: the sampling ranks replace
them with what was accepted (:meth:`RequestTable.record_sampled`), and the
next step cuts any that a stage which does not sample still holds.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from mpexec.models.kv_cache import ScheduledRequest
from mpexec.models.sampler import SampleRequest, TokenHistory
from mpexec.models.split_rule import row_splits
from mpexec.outputs import PLACEHOLDER_TOKEN_ID, SamplingParams, SchedulerOutput


@dataclass
class RequestState:
    req_id: str
    params: SamplingParams
    seed: int
    prompt_len: int  # tokens sent as the prompt (after preemption: with outputs so far)
    block_ids: list[int]
    # every token known so far: prompt, then what was scheduled or sampled
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # the request's own prompt
    min_tokens_stop_ids: tuple[int, ...] = ()
    history: TokenHistory | None = None  # for penalties only


@dataclass
class PromptLogprobsRows:
    """Rows of a step whose logits score prompt tokens (``prompt_logprobs``)."""

    req_id: str
    first_position: int  # position of the token that the first row scores
    rows: list[int]
    targets: list[int]
    top_k: int


@dataclass
class PreparedStep:
    token_ids: list[int]
    positions: list[int]
    layout: list[ScheduledRequest]
    # the rows that sample: the last token of each request that samples, with
    # drafts also the token before each draft (so 1 + drafts rows a request)
    sample_rows: list[int]
    sample_req_ids: list[str]  # one per request that samples
    sample_requests: list[SampleRequest]  # one per sample row
    prompt_logprobs: list[PromptLogprobsRows] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # one per request that samples
    # per row: do packed weights split its activations (``layers.quantized``)
    split: list[bool] = field(default_factory=list)


class RequestTable:
    def __init__(self, default_seed: int) -> None:
        self.default_seed = default_seed
        self.requests: dict[str, RequestState] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        new_ids = set()
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            num_prompt = len(new.prompt_token_ids) if new.num_prompt_tokens is None \
                else new.num_prompt_tokens
            state = RequestState(
                req_id=new.req_id, params=params,
                seed=self._unseeded(new.req_id) if params.seed is None else params.seed,
                prompt_len=len(new.prompt_token_ids), block_ids=list(new.block_ids),
                token_ids=list(new.prompt_token_ids), num_prompt_tokens=num_prompt,
                min_tokens_stop_ids=tuple(new.min_tokens_stop_ids))
            if params.has_penalties:
                state.history = TokenHistory(state.token_ids, num_prompt)
            self.requests[new.req_id] = state
            new_ids.add(new.req_id)
        for req_id, length in scheduler_output.truncated_block_tables.items():
            known = self.requests.get(req_id)
            if known is not None and req_id not in new_ids:
                del known.block_ids[length:]
        for req_id, blocks in scheduler_output.new_block_ids.items():
            if req_id not in new_ids:
                self._get(req_id).block_ids.extend(blocks)

    def _unseeded(self, req_id: str) -> int:
        """A request without a seed draws from the worker's seed mixed with a
        stable hash of its id: the same on every rank and in every batch, yet
        two such requests do not share one noise stream."""
        return self.default_seed * 0x1_0000_0000 + zlib.crc32(req_id.encode())

    def _get(self, req_id: str) -> RequestState:
        try:
            return self.requests[req_id]
        except KeyError:
            raise ValueError(
                f"request {req_id!r} is scheduled but this worker never received its "
                "NewRequestData (or it was finished)") from None

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        step = PreparedStep([], [], [], [], [], [])
        for req_id, tokens in scheduler_output.scheduled_tokens.items():
            if not tokens:
                continue
            state = self._get(req_id)
            start = scheduler_output.num_computed_tokens.get(req_id, 0)
            if start > len(state.token_ids):
                raise ValueError(
                    f"request {req_id!r}: num_computed_tokens {start} skips past the "
                    f"{len(state.token_ids)} tokens this worker knows")
            for offset, token in enumerate(tokens):
                position = start + offset
                if position < len(state.token_ids):
                    if token == PLACEHOLDER_TOKEN_ID:
                        token = state.token_ids[position]
                    else:  # the scheduler's word wins over what was sampled
                        state.token_ids[position] = token
                elif token == PLACEHOLDER_TOKEN_ID:
                    raise ValueError(
                        f"request {req_id!r}: a placeholder at position {position}, but this "
                        "worker has not sampled that token")
                else:
                    state.token_ids.append(token)
                step.token_ids.append(token)
                step.positions.append(position)
                step.split.append(row_splits(position, state.num_prompt_tokens))
            # a decode token with drafts: its rows attend as decode rows do
            verify = bool(scheduler_output.scheduled_spec_decode_tokens.get(req_id))
            step.layout.append(ScheduledRequest(state.block_ids, start, len(tokens), verify))
            end = start + len(tokens)
            if state.params.prompt_logprobs is not None:
                self._prompt_rows(step, state, start, end)
            # rejected drafts of an earlier step, on a stage that does not sample
            del state.token_ids[max(end, state.prompt_len):]
            if end >= state.prompt_len:
                drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
                if end - len(drafts) < max(state.prompt_len, 1) or drafts != tokens[
                        len(tokens) - len(drafts):]:
                    raise ValueError(f"request {req_id!r}: drafts {drafts} are not the end of "
                                     "its decode tokens")
                if drafts and state.history is not None:
                    # its count vectors grow one token at a time and never shrink
                    raise ValueError(f"request {req_id!r}: drafts for a request with penalties")
                last_row = len(step.token_ids) - 1
                for offset in range(len(drafts), -1, -1):
                    position = end - offset  # of the token this row samples
                    step.sample_rows.append(last_row - offset)
                    step.sample_requests.append(SampleRequest(
                        state.params, state.seed, position,
                        num_output_tokens=position - state.num_prompt_tokens,
                        min_tokens_stop_ids=state.min_tokens_stop_ids, history=state.history))
                step.sample_req_ids.append(req_id)
                step.drafts.append(list(drafts))
        return step

    @staticmethod
    def _prompt_rows(step: PreparedStep, state: RequestState, start: int, end: int) -> None:
        """The row of position p scores the prompt token at p + 1."""
        last = min(end, state.num_prompt_tokens - 1)  # positions start .. last - 1
        if last <= start:
            return
        first_row = len(step.token_ids) - (end - start)
        count = last - start
        step.prompt_logprobs.append(PromptLogprobsRows(
            state.req_id, start + 1, list(range(first_row, first_row + count)),
            state.token_ids[start + 1:last + 1], state.params.prompt_logprobs or 0))

    def record_sampled(self, req_ids: list[str], tokens: list[list[int]],
                       drafts: list[list[int]]) -> None:
        """Each request's drafts (the end of its history) give way to the
        tokens it emitted."""
        for req_id, emitted, proposed in zip(req_ids, tokens, drafts, strict=True):
            state = self.requests.get(req_id)
            if state is not None:
                if proposed:
                    del state.token_ids[len(state.token_ids) - len(proposed):]
                state.token_ids.extend(emitted)
