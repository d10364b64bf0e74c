"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

::

    LLM(model="default" | path, tensor_parallel_size, pipeline_parallel_size, ...)
      │ build_engine(EngineArgs(...)) (startup.py): every argument checked, the
      │   workers started, the tokenizer opened, the Engine (or with data
      │   parallel replicas the DataParallelEngine) built over them
      ▼
    generate / generate_stream / chat
      │ every prompt and SamplingParams checked first (validation.py): a bad one is
      │   one ValueError naming the field, and nothing is queued
      │ text -> tokenizer.encode (plain text, exactly as the checkpoint's tokenizer does)
      │ messages -> tokenizer.apply_chat_template(..., add_generation_prompt=True)
      │ Engine.add_request ... Engine.step() until every request finished
      ▼
    list[RequestOutput] (text decoded with skip_special_tokens), or partial
    outputs as tokens arrive (generate_stream: only the new tokens decoded)

A failure of the engine (a worker died or raised) reaches the caller of
``generate`` as the executor's error (``WorkerDiedError``, ``WorkerError``);
the LLM is dead from then on (``EngineDeadError``) and only ``shutdown()``
remains to do.  ``worker_cls`` and ``tokenizer`` let an engine builder run
the same API on a worker of their own (the tests use a fake model).

Several nodes: ``LLM(..., nnodes=N, master_addr=..., master_port=...)`` on
the leader (node 0; the cluster secret from ``cluster_secret=`` or
``MPEXEC_CLUSTER_SECRET``) waits for ``mpexec node`` on every other node;
those run the remaining ranks and open the checkpoint at the same path (or
fetch "default" themselves).  Everything else - tokenizer, scheduler, KV
cache sizing - runs on the leader as on one node; how data parallel
replicas are spread over the nodes is startup.py's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from mpexec.engine.dp import DataParallelEngine
from mpexec.engine.engine import Engine
from mpexec.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from mpexec.engine.request import Request, child_params
from mpexec.engine.startup import (
    MODEL_WORKER,
    EngineArgs,
    Message,
    TokenizerLike,
    build_engine,
    cuda_available,
)
from mpexec.engine.stream_text import StreamText
from mpexec.engine.validation import check_params, prepare_prompt
from mpexec.outputs import LogprobsRow, SamplingParams

__all__ = [
    "LLM",
    "MODEL_WORKER",
    "ProgressCallback",
    "PromptType",
    "TokenizerLike",
    "cuda_available",
]

# A prompt: text, {"prompt": text}, or {"prompt_token_ids": [...]} (optionally
# with "prompt": text).
PromptType = str | dict[str, Any]
ProgressCallback = Callable[[int, int, int], None]


class LLM:
    """A model on N workers, with continuous batching, for offline generation."""

    def __init__(
        self,
        model: str | os.PathLike[str] = "default",
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        decode_context_parallel_size: int = 1,
        prefill_context_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        replica_restart: bool = False,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        executor_backend: str | type = "mp",
        dtype: str = "auto",
        quantization: str = "auto",
        seed: int = 0,
        async_scheduling: bool = False,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_transfer_config: dict[str, Any] | str | None = None,
        speculative_config: dict[str, Any] | str | None = None,
        kv_cache_memory_bytes: int | None = None,
        device: str = "auto",
        distributed_backend: str = "auto",
        num_threads: int | None = None,
        worker_cls: str | type = MODEL_WORKER,
        worker_kwargs: dict[str, Any] | None = None,
        tokenizer: TokenizerLike | str | os.PathLike[str] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        **executor_fields: Any,
    ) -> None:
        self._engine: Engine | DataParallelEngine | None = None
        built = build_engine(EngineArgs(
            model=model, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            decode_context_parallel_size=decode_context_parallel_size,
            prefill_context_parallel_size=prefill_context_parallel_size,
            data_parallel_size=data_parallel_size, enable_expert_parallel=enable_expert_parallel,
            replica_restart=replica_restart, nnodes=nnodes, node_rank=node_rank,
            master_addr=master_addr, master_port=master_port, executor_backend=executor_backend,
            dtype=dtype, quantization=quantization, seed=seed, async_scheduling=async_scheduling,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, kv_transfer_config=kv_transfer_config,
            speculative_config=speculative_config, kv_cache_memory_bytes=kv_cache_memory_bytes,
            device=device, distributed_backend=distributed_backend, num_threads=num_threads,
            worker_cls=worker_cls, worker_kwargs=worker_kwargs, tokenizer=tokenizer,
            eos_token_ids=eos_token_ids, executor_fields=executor_fields))
        self._engine = built.engine
        self.model = str(model)
        self.vocab_size: int | None = built.vocab_size
        self.tokenizer: TokenizerLike = built.tokenizer
        self._clock_offset = time.time() - time.monotonic()

    @property
    def engine(self) -> Any:
        """The :class:`Engine`, or with several replicas (or ``replica_restart``) the
        :class:`~mpexec.engine.dp.DataParallelEngine` that has the same API."""
        if self._engine is None:
            raise RuntimeError("the LLM was not started")
        return self._engine

    # -- generation ----------------------------------------------------------------

    def get_tokenizer(self) -> TokenizerLike:
        """The tokenizer prompts are encoded and outputs decoded with."""
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: ProgressCallback | None = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; one finished output per prompt, in order.

        ``progress(finished, total, generated_tokens)`` is called as tokens
        arrive; ``use_tqdm`` shows a progress bar on stderr.
        """
        groups = self._add(self._prompts(prompts), sampling_params)
        requests = [r for g in groups for r in g.children]
        bar = _ProgressBar(len(groups)) if use_tqdm else None
        try:
            for _ in self._run(requests):
                done = sum(g.finished for g in groups)
                if bar is not None:
                    bar.update(done)
                if progress is not None:
                    progress(done, len(groups), sum(len(r.output_token_ids) for r in requests))
        finally:
            if bar is not None:
                bar.close()
            # A progress callback that raised, or Ctrl-C between steps: the
            # requests must not stay in the batch of every later call.
            self._abort_unfinished(requests)
        return [self._group_output(g) for g in groups]

    def generate_stream(self, prompts: PromptType | Sequence[PromptType],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        ) -> Iterator[RequestOutput]:
        """Partial outputs as tokens arrive; each request's last one has ``finished``.

        The text grows by the characters the new tokens complete (only they
        are decoded); bytes of a character still unfinished are held back,
        and so is a tail that could be the start of one of its stop strings.
        """
        groups = self._add(self._prompts(prompts), sampling_params)
        requests = [r for g in groups for r in g.children]
        owner = {r.req_id: g for g in groups for r in g.children}
        decoders = {r.req_id: StreamText(self.tokenizer, r.sampling_params.skip_special_tokens)
                    for r in requests}
        try:
            for changed in self._run(requests):
                for request in changed:
                    decoders[request.req_id].update(request.output_token_ids,
                                                    request.is_finished)
                for group in dict.fromkeys(owner[r.req_id] for r in changed):
                    yield self._group_output(group, {r.req_id: decoders[r.req_id].text
                                                     for r in group.children})
        finally:
            # A caller that stops reading early must not leave its requests running.
            self._abort_unfinished(requests)

    def _abort_unfinished(self, requests: list[Request]) -> None:
        if self._engine is not None and not self._engine.is_dead:
            for request in requests:
                if not request.is_finished:
                    self._engine.abort_request(request.req_id)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             progress: ProgressCallback | None = None, *, use_tqdm: bool = False,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate a reply to one conversation, or to each of several.

        ``chat_template`` replaces the checkpoint's template;
        ``continue_final_message`` leaves the last message open so the model
        continues it (it needs ``add_generation_prompt=False``).
        """
        prompts = self.chat_prompts(messages, chat_template=chat_template,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message)
        return self.generate(prompts, sampling_params, progress, use_tqdm=use_tqdm)

    def chat_prompts(self, messages: list[Message] | Sequence[list[Message]], *,
                     chat_template: str | None = None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False) -> list[dict[str, Any]]:
        """Token prompts built with the checkpoint's chat template (or ``chat_template``)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            turns: list[Message] = list(conversation)  # type: ignore[arg-type]
            if chat_template is None and not continue_final_message:
                ids = self.tokenizer.apply_chat_template(
                    turns, add_generation_prompt=add_generation_prompt)
            else:
                ids = self._render_chat(turns, chat_template, add_generation_prompt,
                                        continue_final_message)
            prompts.append({"prompt_token_ids": ids})
        return prompts

    def _render_chat(self, conversation: list[Message], chat_template: str | None,
                     add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
        render = getattr(self.tokenizer, "chat_prompt", None)
        if render is None:
            raise ValueError("chat_template= and continue_final_message= need the "
                             "checkpoint's tokenizer")
        text: str = render(conversation, add_generation_prompt=add_generation_prompt,
                           template=chat_template)
        if continue_final_message:
            # As transformers does: cut the rendering right after the last
            # message's content, dropping the end-of-turn markup after it.
            final = str(conversation[-1].get("content", "")).strip() if conversation else ""
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ValueError("continue_final_message: the chat template does not render "
                                 "the final message's content as it is")
            text = text[:at + len(final)]
        return list(self.tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]

    def _prompts(self, prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if prompts is None or isinstance(prompts, (str, bytes, bytearray, dict)):
            return [prompts]  # None: refused by prepare_prompt
        return list(prompts)

    def _add(self, prompts: list[PromptType],
             params: SamplingParams | Sequence[SamplingParams] | None) -> list[_Group]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            per_prompt = [params] * len(prompts)
        elif isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        else:
            per_prompt = [check_params(params)]  # raises: the type is wrong
        # Everything is checked before the first request is queued.
        several = len(prompts) > 1
        checked = []
        for index, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            where = index if several else None
            checked.append((*self._tokenize(prompt, where), check_params(p, where)))
        added: list[_Group] = []
        try:
            for text, ids, p in checked:
                group = _Group(text, [])
                added.append(group)
                for child in child_params(p):  # n completions: one request each
                    group.children.append(self.engine.add_request(ids, child))
        except BaseException:
            for group in added:
                for request in group.children:
                    self.engine.abort_request(request.req_id)
            raise
        return added

    def _tokenize(self, prompt: PromptType, index: int | None) -> tuple[str | None, list[int]]:
        return prepare_prompt(prompt, self.tokenizer.encode, self.vocab_size,
                              self.engine.limits.max_model_len, index)

    def _run(self, requests: list[Request]) -> Iterator[list[Request]]:
        """Step until ``requests`` finish; after each step, those of them that changed.

        Whoever drives a step (another ``generate_stream`` of this LLM, say),
        a request's change is seen here: each one is compared with what was
        last handed out, so a request that finished in someone else's step
        still yields its final state.
        """
        seen = {r.req_id: (0, False) for r in requests}

        def changed() -> list[Request]:
            fresh = []
            for request in requests:
                state = (len(request.output_token_ids), request.is_finished)
                if state != seen[request.req_id]:
                    seen[request.req_id] = state
                    fresh.append(request)
            return fresh

        def raise_failed() -> None:
            for request in requests:
                if request.error is not None:
                    raise request.error

        while any(not r.is_finished for r in requests):
            self.engine.step()
            raise_failed()
            mine = changed()
            if mine:
                yield mine
        raise_failed()
        mine = changed()
        if mine:
            yield mine

    def _group_output(self, group: _Group,
                      texts: dict[str, str] | None = None) -> RequestOutput:
        """One prompt's output: a completion per request of the group (``texts``:
        their streamed texts; else each is decoded whole)."""
        first = group.children[0]
        offset = self._clock_offset

        def wall(t: float | None) -> float | None:
            return None if t is None else t + offset

        first_tokens = [r.first_token_time for r in group.children
                        if r.first_token_time is not None]
        finish_times = [r.finish_time for r in group.children]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time + offset,
            first_token_time=wall(min(first_tokens)) if first_tokens else None,
            finish_time=wall(max(t for t in finish_times if t is not None))
            if None not in finish_times else None)
        completions = [self._completion(i, r, texts[r.req_id] if texts else None)
                       for i, r in enumerate(group.children)]
        return RequestOutput(
            request_id=first.req_id, prompt=group.prompt,
            prompt_token_ids=list(first.prompt_token_ids), outputs=completions,
            finished=group.finished, metrics=metrics,
            num_preemptions=sum(r.num_preemptions for r in group.children),
            prompt_logprobs=self._prompt_logprobs(first))

    def _output(self, request: Request, prompt: str | None,
                text: str | None = None) -> RequestOutput:
        """The output of one request (``text``: its streamed text, else decoded)."""
        return self._group_output(_Group(prompt, [request]),
                                  None if text is None else {request.req_id: text})

    def _completion(self, index: int, request: Request, text: str | None) -> CompletionOutput:
        params = request.sampling_params
        tokens = list(request.output_token_ids)
        reason = request.finish_reason.value if request.finish_reason is not None else None
        if request.stop_text is not None:  # stop strings: their text, held back while running
            text = request.stop_text.final() if request.is_finished else request.stop_text.visible
        elif text is None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
        logprobs = None
        if params.logprobs is not None:
            done = request.logprob_dicts
            done.extend(self._position_logprobs(row)
                        for row in request.output_logprobs[len(done):])
            logprobs = list(done)
        return CompletionOutput(
            index=index, text=text, token_ids=tokens, finish_reason=reason,
            logprobs=logprobs,
            cumulative_logprob=request.cumulative_logprob if logprobs is not None else None,
            stop_reason=request.stop_reason)

    def _prompt_logprobs(self, request: Request) -> list[PositionLogprobs | None] | None:
        if request.sampling_params.prompt_logprobs is None:
            return None
        return [None, *(self._position_logprobs(row) for row in request.prompt_logprobs)]

    def _position_logprobs(self, row: LogprobsRow) -> PositionLogprobs:
        """vLLM's shape: token id -> Logprob, the top-k (ranks 1..k) and the chosen token."""
        def text(token: int) -> str:
            return self.tokenizer.decode([token], skip_special_tokens=False)

        out = {token: Logprob(lp, rank, text(token))
               for rank, (token, lp) in enumerate(zip(row.top_ids, row.top_logprobs,
                                                      strict=True), start=1)}
        if row.token_id not in out:
            out[row.token_id] = Logprob(row.logprob, row.rank, text(row.token_id))
        return out

    # -- profiling --------------------------------------------------------------------

    def start_profile(self, trace_dir: str | None = None) -> None:
        """Every worker starts timing the model's marked phases (and, with
        ``trace_dir``, records a torch profiler trace there, one file per rank)."""
        for executor in self._executors():
            executor.collective_rpc("start_profile", args=(trace_dir,))

    def stop_profile(self) -> list[Any]:
        """Stop the profile; one :class:`~mpexec.models.profiling.ProfileSummary`
        per worker (per replica, in replica order)."""
        return [summary for executor in self._executors()
                for summary in executor.collective_rpc("stop_profile")]

    def _executors(self) -> list[Any]:
        engine = self.engine
        if isinstance(engine, DataParallelEngine):
            return [replica.executor for replica in engine.replicas if replica is not None]
        return [engine.executor]

    # -- end --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        if self._engine is not None:
            self._engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


@dataclass(eq=False)
class _Group:
    """The requests of one prompt (``SamplingParams.n`` of them)."""

    prompt: str | None
    children: list[Request]

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.children)


class _ProgressBar:
    """``use_tqdm``'s bar: one line on stderr, rewritten as prompts finish.

    (tqdm itself would allocate a multiprocessing lock, a named semaphore,
    in the driver; this needs nothing.)
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self._write()

    def update(self, done: int) -> None:
        if done != self.done:
            self.done = done
            self._write()

    def _write(self) -> None:
        width = 30
        filled = width * self.done // max(1, self.total)
        elapsed = time.monotonic() - self.started
        sys.stderr.write(f"\rProcessed prompts: [{'#' * filled}{'.' * (width - filled)}] "
                         f"{self.done}/{self.total} {elapsed:.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
