"""A model worker without a model: the model-worker API, deterministic, no torch.

The "model" picks the next token of a request as a hash of the request's
tokens so far (and its seed, unless greedy) modulo ``vocab_size``, so the
tokens of a request depend only on its own tokens, exactly the property a
real sampler guarantees.  The worker also checks what the scheduler sends:

- a scheduled token at a known position must equal the known token (or be
  ``PLACEHOLDER_TOKEN_ID``, which only PP = 1 may send, and only for the
  token this worker sampled itself);
- positions are contiguous (``num_computed_tokens`` is where the request is);
- the block table covers every position written, and a block held by two
  live requests (a shared prefix-cache block) is never written;
- a request that starts past position 0 (its prefix served by the prefix
  cache) finds, in each of those blocks, the KV this worker wrote for the
  same tokens (the worker remembers which tokens filled each full block);

and raises ``AssertionError`` otherwise.  Ranks of the last pipeline stage
sample; the output rank (first TP rank of the last stage) returns the
``ModelRunnerOutput``.  ``die_at_step`` / ``raise_at_step`` make one rank
(``fault_rank``) die or raise in ``execute_model`` at that step;
``refuse_token`` makes every rank raise ``ValueError`` for a step in which a
new request's prompt holds that token (a request the workers refuse).
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from mpexec.executor import WorkerBase, WorkerContext
from mpexec.outputs import (
    PLACEHOLDER_TOKEN_ID,
    GrammarOutput,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)

VOCAB_SIZE = 97
BLOCK_BYTES = 1024


def next_token(tokens: list[int], params: SamplingParams, engine_seed: int,
               vocab_size: int = VOCAB_SIZE) -> int:
    """The fake model: a hash of the tokens so far (and the seed when sampling)."""
    seed = 0 if params.greedy else (engine_seed if params.seed is None else params.seed) + 1
    data = f"{seed}:{','.join(map(str, tokens))}".encode()
    return zlib.crc32(data) % vocab_size


@dataclass
class _ReqState:
    tokens: list[int]
    params: SamplingParams
    block_ids: list[int] = field(default_factory=list)


class FakeModelWorker(WorkerBase):
    def __init__(self, context: WorkerContext, *, vocab_size: int = VOCAB_SIZE,
                 block_size: int = 4, kv_bytes: int = 64 * BLOCK_BYTES, seed: int = 0,
                 die_at_step: int | None = None, raise_at_step: int | None = None,
                 fault_rank: int = 0, step_delay_s: float = 0.0,
                 refuse_token: int | None = None, **kwargs: Any) -> None:
        super().__init__(context, **kwargs)
        parallel = context.config.parallel
        ranks = context.ranks
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.kv_bytes = kv_bytes
        self.seed = seed
        self.die_at_step = die_at_step
        self.raise_at_step = raise_at_step
        self.fault_rank = fault_rank
        self.step_delay_s = step_delay_s
        self.refuse_token = refuse_token
        self.is_last_stage = ranks.pp == parallel.pipeline_parallel_size - 1
        self.is_output_rank = self.is_last_stage and ranks.tp == 0
        self.allows_placeholders = parallel.pipeline_parallel_size == 1
        self.num_blocks = 0
        self.requests: dict[str, _ReqState] = {}
        self._pending: list[tuple[str, int]] = []
        self._execute_s = 0.0
        self.steps_seen: list[int] = []
        # block -> the tokens from position 0 to the end of the block, when it was filled
        self.block_contents: dict[int, tuple[int, ...]] = {}

    def determine_available_memory(self) -> int:
        return self.kv_bytes

    def kv_cache_block_bytes(self) -> int:
        return BLOCK_BYTES

    def initialize_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        started = time.perf_counter()
        step = scheduler_output.step
        self.steps_seen.append(step)
        if self.rank == self.fault_rank and step == self.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == self.fault_rank and step == self.raise_at_step:
            raise ValueError(f"fake failure at step {step}")
        for new in scheduler_output.scheduled_new_reqs:
            if self.refuse_token is not None and self.refuse_token in new.prompt_token_ids:
                raise ValueError(f"{new.req_id}: token {self.refuse_token} refused")
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent twice"
            self.requests[new.req_id] = _ReqState(
                list(new.prompt_token_ids), new.sampling_params, list(new.block_ids))
            self._check_cached_prefix(new.req_id, new.prompt_token_ids, new.block_ids,
                                      scheduler_output.num_computed_tokens.get(new.req_id, 0))
        for req_id, blocks in scheduler_output.new_block_ids.items():
            self.requests[req_id].block_ids.extend(blocks)
        self._check_blocks()
        self._pending = []
        for req_id, tokens in scheduler_output.scheduled_tokens.items():
            state = self.requests[req_id]
            start = scheduler_output.num_computed_tokens[req_id]
            for offset, token in enumerate(tokens):
                self._place(state, start + offset, token, req_id)
                self._write(state, start + offset, req_id)
            end = start + len(tokens)
            assert end <= len(state.block_ids) * self.block_size, \
                f"{req_id}: {end} tokens do not fit {len(state.block_ids)} blocks"
            if end >= len(state.tokens) and self.is_last_stage:
                token = next_token(state.tokens[:end], state.params, self.seed, self.vocab_size)
                state.tokens = [*state.tokens[:end], token]
                self._pending.append((req_id, token))
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self._execute_s = time.perf_counter() - started

    def _place(self, state: _ReqState, position: int, token: int, req_id: str) -> None:
        if position < len(state.tokens):
            if token == PLACEHOLDER_TOKEN_ID:
                assert self.allows_placeholders, f"{req_id}: placeholder sent with PP > 1"
                assert position == len(state.tokens) - 1, \
                    f"{req_id}: placeholder at {position}, not the last sampled token"
            else:
                assert token == state.tokens[position], \
                    f"{req_id}: token {token} at {position}, expected {state.tokens[position]}"
        else:
            assert position == len(state.tokens), f"{req_id}: gap at position {position}"
            assert token != PLACEHOLDER_TOKEN_ID, f"{req_id}: placeholder for an unknown token"
            state.tokens.append(token)

    def _check_blocks(self) -> None:
        self.holders: dict[int, list[str]] = {}
        for req_id, state in self.requests.items():
            assert len(set(state.block_ids)) == len(state.block_ids), f"{req_id}: block twice"
            for block in state.block_ids:
                assert 0 <= block < self.num_blocks, f"block {block} out of range"
                self.holders.setdefault(block, []).append(req_id)

    def _check_cached_prefix(self, req_id: str, tokens: list[int], block_ids: list[int],
                             start: int) -> None:
        assert start % self.block_size == 0, f"{req_id}: a cached prefix ends mid-block"
        assert start < len(tokens), f"{req_id}: no token left to compute"
        for index in range(start // self.block_size):
            want = tuple(tokens[:(index + 1) * self.block_size])
            got = self.block_contents.get(block_ids[index])
            assert got == want, f"{req_id}: cached block {block_ids[index]} holds other tokens"

    def _write(self, state: _ReqState, position: int, req_id: str) -> None:
        block = state.block_ids[position // self.block_size]
        holders = self.holders.get(block, [])
        assert holders == [req_id], f"{req_id} writes block {block} shared with {holders}"
        if position % self.block_size == 0:
            self.block_contents.pop(block, None)
        if position % self.block_size == self.block_size - 1:
            self.block_contents[block] = tuple(state.tokens[:position + 1])

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        if not self.is_output_rank:
            return None
        pending, self._pending = self._pending, []
        return ModelRunnerOutput(
            req_ids=[req_id for req_id, _ in pending],
            sampled_token_ids=[[token] for _, token in pending],
            extra={"worker_execute_s": self._execute_s, "worker_sample_s": 0.0})


def reference_tokens(prompt: list[int], params: SamplingParams, *, seed: int = 0,
                     eos_token_ids: tuple[int, ...] = (), max_model_len: int = 10**9,
                     vocab_size: int = VOCAB_SIZE) -> tuple[list[int], str]:
    """What a request must produce, computed without any engine."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        token = next_token(tokens, params, seed, vocab_size)
        tokens.append(token)
        out.append(token)
        if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"
