"""A hand-built scheduler for the worker tests (the real one is the engine's).

:class:`StepDriver` prefills every prompt (whole, or in chunks), then decodes
one token per request per step, growing block tables through
``new_block_ids`` and forgetting finished requests through
``finished_req_ids``, exactly as the protocol in ``mpexec.outputs`` says.
With ``fetch_logits`` it also collects, from the output rank, the float32
logits each step sampled from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpexec import Executor, ExecutorConfig, ParallelConfig
from mpexec.outputs import (
    PLACEHOLDER_TOKEN_ID,
    GrammarOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

BLOCK_SIZE = 4


def make_executor(model: Path | str, *, tp: int = 1, pp: int = 1, dcp: int = 1, pcp: int = 1,
                  backend: str = "mp", num_blocks: int = 128, ep: bool = False,
                  dp: tuple[int, int] = (0, 1), executor_fields: dict[str, Any] | None = None,
                  **worker_kwargs: Any) -> Executor:
    """An executor of ModelWorkers with its KV cache sized the way the engine does.

    Quantised weights are dequantised (``quantization="none"``) unless the
    caller asks otherwise: these runs are compared with transformers' float32."""
    kwargs = dict(model=str(model), block_size=BLOCK_SIZE, num_threads=1,
                  kv_cache_memory_bytes=64 << 20, quantization="none")
    kwargs.update(worker_kwargs)
    fields: dict[str, Any] = dict(startup_timeout_s=120.0, execute_model_timeout_s=120.0,
                                  shutdown_grace_s=5.0, shutdown_term_s=5.0)
    fields.update(executor_fields or {})
    config = ExecutorConfig(
        worker_cls="mpexec.models.worker:ModelWorker", worker_kwargs=kwargs,
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                decode_context_parallel_size=dcp,
                                prefill_context_parallel_size=pcp,
                                enable_expert_parallel=ep, data_parallel_rank=dp[0],
                                data_parallel_size=dp[1]),
        executor_backend=backend, device_type="cpu", **fields)
    executor = Executor.get_class(config)(config)
    try:
        memory = executor.collective_rpc("determine_available_memory")
        block_bytes = executor.collective_rpc("kv_cache_block_bytes")
        fit = min(m // b for m, b in zip(memory, block_bytes, strict=True))
        executor.collective_rpc("initialize_cache", args=(min(fit, num_blocks),))
    except BaseException:
        executor.shutdown()
        raise
    return executor


def pending_logits(wrapper: Any) -> Any:
    """Runs inside a worker: the logits its last execute_model kept (last stage)."""
    worker = wrapper.worker
    if not worker.pending:
        return None
    logits = worker.pending[-1].logits
    return None if logits is None else logits.clone()


@dataclass
class Run:
    prompt: list[int]
    params: SamplingParams
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    output: list[int] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class StepDriver:
    def __init__(self, executor: Executor, *, chunk: int | None = None,
                 placeholders: bool = False, fetch_logits: bool = False,
                 first_block: int = 0, block_tokens: int = BLOCK_SIZE) -> None:
        self.executor = executor
        self.chunk = chunk
        self.placeholders = placeholders
        self.fetch_logits = fetch_logits
        self.next_block = first_block
        self.block_tokens = block_tokens  # tokens per block: BLOCK_SIZE x DCP
        self.step = 0

    def _grow(self, run: Run, upto: int) -> list[int]:
        needed = math.ceil(upto / self.block_tokens) - len(run.blocks)
        fresh = list(range(self.next_block, self.next_block + max(needed, 0)))
        self.next_block += len(fresh)
        run.blocks.extend(fresh)
        return fresh

    def generate(self, requests: dict[str, tuple[list[int], SamplingParams]],
                 grammar: GrammarOutput | None = None) -> dict[str, Run]:
        runs = {rid: Run(list(prompt), params) for rid, (prompt, params) in requests.items()}
        unseen = set(runs)
        finished: set[str] = set()
        active = dict(runs)
        while active:
            output = SchedulerOutput(step=self.step, finished_req_ids=finished)
            finished = set()
            for rid, run in active.items():
                if run.computed < len(run.prompt):
                    stop = len(run.prompt) if self.chunk is None else min(
                        len(run.prompt), run.computed + self.chunk)
                    tokens = run.prompt[run.computed:stop]
                else:
                    tokens = [PLACEHOLDER_TOKEN_ID if self.placeholders else run.output[-1]]
                fresh = self._grow(run, run.computed + len(tokens))
                if rid in unseen:
                    unseen.discard(rid)
                    output.scheduled_new_reqs.append(
                        NewRequestData(rid, run.prompt, run.params, list(run.blocks)))
                elif fresh:
                    output.new_block_ids[rid] = fresh
                output.scheduled_tokens[rid] = tokens
                output.num_computed_tokens[rid] = run.computed
                run.computed += len(tokens)
            self.executor.execute_model(output)
            if self.fetch_logits:
                logits = self.executor.collective_rpc(
                    pending_logits, unique_reply_rank=self.executor.output_rank)
            result = self.executor.sample_tokens(grammar)
            self.step += 1
            sampled = zip(result.req_ids, result.sampled_token_ids, strict=True)
            for row, (rid, tokens) in enumerate(sampled):
                run = active[rid]
                run.output.extend(tokens)
                if self.fetch_logits:
                    run.logits.append(logits[row])
                if result.logprobs is not None and result.logprobs[row] is not None:
                    run.logprobs.append(result.logprobs[row][0].logprob)
                if len(run.output) >= run.params.max_tokens:
                    finished.add(rid)
            for rid in finished:
                del active[rid]
        if finished:  # let the workers forget the last ones too
            self.executor.execute_model(SchedulerOutput(step=self.step,
                                                        finished_req_ids=finished))
            self.executor.sample_tokens(None)
            self.step += 1
        return runs
