"""ModelWorker: one rank of a tensor/pipeline-parallel Llama, driven by the executor.

The executor broadcasts every call to every rank, in order::

    init_device ─ load_model ─ determine_available_memory / kv_cache_block_bytes
      ─ initialize_cache(num_blocks) ─ { execute_model(step) ─ sample_tokens(grammar) }*
      ─ shutdown

``execute_model`` replays the step into the request table, lays the tokens
out, and runs this rank's stage:

- first stage: token ids → embedding; other stages: ``recv_tensor_dict``
  of ``{hidden, residual}`` from the previous stage (PP group);
- not the last stage: ``send_tensor_dict`` to the next stage and done;
- last stage: logits of the rows that sample, queued for ``sample_tokens``.

Because a stage blocks only on its own input, stage 0 can run step N+1
while stage 1 still runs step N: with PP the executor's
``max_concurrent_batches`` micro-batches (disjoint requests) are in flight,
and the last stage's queue of pending logits is consumed in call order.
Every rank of the last stage samples (all hold the same gathered logits,
so all pick the same tokens and can resolve ``PLACEHOLDER_TOKEN_ID``); the
output rank (TP rank 0 of the last stage) returns the ModelRunnerOutput.

A KV connector (``kv_transfer_config``) wraps each step: its loads before
the forward (``start_load_kv``; ``wait_for_layer_load`` per local layer),
its saves after it (``save_kv_layer`` per local layer, ``wait_for_save``);
then every rank, not only the output rank, replies to ``sample_tokens``
with what it finished (``KVConnectorOutput``), for the executor's
aggregator to merge.

With world size 1 the worker uses one-rank stand-in groups and never
initialises ``torch.distributed`` (so in-process executors can coexist).
"""

from __future__ import annotations

import array
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mpexec.executor.context import WorkerContext
from mpexec.executor.worker_base import WorkerBase
from mpexec.models import profiling, spec_decode
from mpexec.models.context_parallel import DcpBatch, build_dcp_batch, dcp_head_counts
from mpexec.models.kv_cache import (
    AttentionBatch,
    KVCache,
    ScheduledRequest,
    build_attention_batch,
    kv_block_bytes,
    memory_budget,
)
from mpexec.models.kv_connector import (
    KVConnectorBase,
    KVConnectorRole,
    KVTransferConfig,
    create_connector,
)
from mpexec.models.layers.parallel import SingleRankGroup
from mpexec.models.layers.quantized import SplitRows, splitting
from mpexec.models.llama import LlamaStage, load_stage
from mpexec.models.ngram import SpeculativeConfig
from mpexec.models.prefill_parallel import PcpBatch, gather_rows, rows_layout, split_step
from mpexec.models.quantization import check_quantization
from mpexec.models.sampler import (
    SampleRequest,
    argmax_suffices,
    logprob_rows,
    sample,
    unpack_bitmask,
)
from mpexec.models.sharding import pipeline_layers, rank_share
from mpexec.models.step import PreparedStep, PromptLogprobsRows, RequestTable
from mpexec.outputs import (
    DraftTokenIds,
    GrammarOutput,
    KVConnectorOutput,
    LogprobsRow,
    ModelRunnerOutput,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}; got {name!r}") from None


def _open_checkpoint(spec: str) -> Any:
    from mpexec.models.loader import open_checkpoint

    path = Path(spec)
    if not path.exists():  # a named model, or a missing path resolve_model explains
        from mpexec.models.fetch import resolve_model

        path = resolve_model(spec)
    return open_checkpoint(path)


@dataclass
class PendingStep:
    """A step whose logits wait for ``sample_tokens`` (last stage only)."""

    req_ids: list[str]  # one per request that samples
    requests: list[SampleRequest]  # one per logits row
    logits: torch.Tensor | None
    execute_s: float
    prompt_rows: list[PromptLogprobsRows] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None
    drafts: list[list[int]] = field(default_factory=list)  # one per request that samples


class ModelWorker(WorkerBase):
    def __init__(self, context: WorkerContext, *, model: str = "default", dtype: str = "auto",
                 block_size: int = 16, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 2048, kv_cache_memory_bytes: int | None = None,
                 seed: int = 0, pp_layer_partition: list[int] | None = None,
                 num_threads: int | None = None,
                 kv_transfer_config: dict[str, Any] | None = None,
                 quantization: str = "auto",
                 speculative_config: dict[str, Any] | None = None) -> None:
        super().__init__(context)
        self.quantization = check_quantization(quantization)
        for name, value in (("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        self.model_spec = model
        self.dtype_name = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.seed = seed
        self.pp_layer_partition = pp_layer_partition
        self.num_threads = num_threads
        parallel = context.config.parallel
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        ranks = context.ranks
        self.tp_rank = ranks.tp
        self.pp_rank = ranks.pp
        # decode context parallelism: each request's KV spread over the DCP group
        self.dcp_size = parallel.decode_context_parallel_size
        self.dcp_rank = ranks.dcp
        self.dcp_group: Any = None
        # prefill context parallelism: a long step's rows split over the PCP group
        self.pcp_size = parallel.prefill_context_parallel_size
        self.pcp_rank = ranks.pcp
        self.pcp_group: Any = None
        self.pcp_split_steps = 0  # steps whose rows this rank shared with its PCP group
        self.expert_parallel = parallel.enable_expert_parallel
        # Experts split over every replica's ranks: one world across the replicas,
        # whose DP group the MoE layers gather over.
        self.ep_across_replicas = self.expert_parallel and parallel.data_parallel_size > 1
        # The groups come with join_data_parallel (mpexec.models.dp_world): with
        # experts across the replicas, or dense replicas sharing one world.
        self.joins_replicas = parallel.joins_replica_world
        self.joined = False
        # Dense replicas with replica_restart: a world each, and a DP group
        # outside it formed by generation (join_dp_group, mpexec.models.dp_world).
        self.detached_dp = parallel.detached_dp_group and parallel.data_parallel_size > 1
        self.ep_group: Any = None
        self.dp_group: Any = None
        self.device = torch.device(context.device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.tp_group: Any = None
        self.pp_group: Any = None
        self.owns_distributed = False
        self.model_config: Any = None
        self.stage: LlamaStage | None = None
        self.cache: KVCache | None = None
        self.layer_range = (0, 0)
        self.kv_head_range = (0, 0)
        self.requests = RequestTable(seed)
        self.pending: deque[PendingStep] = deque()
        self.last_sampled_req_ids: list[str] = []
        # how take_draft_token_ids proposes (the engine's; else the defaults)
        self.speculative = SpeculativeConfig.from_dict(speculative_config or {})
        self.connector: KVConnectorBase | None = None
        if kv_transfer_config is not None:
            self.connector = create_connector(KVTransferConfig(**kv_transfer_config),
                                              KVConnectorRole.WORKER, rank=self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        return self.is_last_stage and self.tp_rank == 0 and self.pcp_rank == 0

    # -- start-up -----------------------------------------------------------------

    def init_device(self) -> None:
        parallel = self.config.parallel
        if self.expert_parallel and self.pcp_size > 1:
            raise ValueError("enable_expert_parallel with prefill_context_parallel_size > 1 "
                             "is not supported: the experts are split across the TP ranks, "
                             "which must hold the same tokens")
        if self.pcp_size > 1 and self.dcp_size > 1:
            raise ValueError(
                f"prefill_context_parallel_size ({self.pcp_size}) and "
                f"decode_context_parallel_size ({self.dcp_size}) cannot be combined yet: "
                "use one of them")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        if self.joins_replicas:
            return  # the groups come with join_data_parallel
        if self.detached_dp:
            from mpexec.models.dp_world import install_unformed_dp_group

            install_unformed_dp_group(self.context)
        if self.context.world_size == 1:
            self.tp_group = self.pp_group = SingleRankGroup()
            return
        from mpexec import distributed

        distributed.init_distributed_environment(
            world_size=self.context.world_size, rank=self.rank, local_rank=self.local_rank,
            distributed_init_method=self.distributed_init_method, backend=self.context.backend)
        # This world is one data parallel replica (one replica of one, or with
        # replica_restart a dense replica that must be rebuilt alone, whose DP
        # group lives outside it: join_dp_group): its own DP group is of one.
        distributed.initialize_model_parallel(
            tensor_model_parallel_size=self.tp_size, pipeline_model_parallel_size=self.pp_size,
            prefill_context_model_parallel_size=self.pcp_size,
            decode_context_model_parallel_size=self.dcp_size,
            enable_expert_parallel=self.expert_parallel)
        self.owns_distributed = True
        distributed.setup_proc_title_and_log_prefix(
            (parallel.data_parallel_rank, parallel.data_parallel_size))
        self.tp_group = distributed.get_tp_group()
        self.pp_group = distributed.get_pp_group()
        if self.dcp_size > 1:
            self.dcp_group = distributed.get_dcp_group()
        if self.pcp_size > 1:
            self.pcp_group = distributed.get_pcp_group()

    def join_data_parallel(self, init_method: str) -> None:
        """Join the world of every replica's workers at ``init_method``
        (``mpexec.models.dp_world``), then load the model."""
        from mpexec.models.dp_world import join_replica_world

        groups = join_replica_world(self.context, init_method)
        self.owns_distributed = True
        self.joined = True
        self.tp_group, self.pp_group, self.dp_group = groups.tp, groups.pp, groups.dp
        self.ep_group, self.dcp_group, self.pcp_group = groups.ep, groups.dcp, groups.pcp
        self.load_model()

    def join_dp_group(self, host: str, port: int, generation: int, timeout_s: float) -> int:
        """Form generation ``generation`` of the DP group outside this replica's
        world (``mpexec.models.dp_world``, dense replicas with
        ``replica_restart``); between steps.  Returns the generation."""
        from mpexec.models.dp_world import join_dp_generation

        if not self.detached_dp:
            raise RuntimeError("join_dp_group: this worker's DP group is not detached "
                               "(ParallelConfig.detached_dp_group with data_parallel_size > 1)")
        join_dp_generation(self.context, host, port, generation, timeout_s)
        return generation

    def retire_dp_group(self, before: int, reason: str) -> None:
        """Retire the detached DP group if older than generation ``before``: its
        collectives raise ``StaleGroupError`` from now on."""
        from mpexec.models.dp_world import retire_dp_generation

        retire_dp_generation(before, reason)

    def load_model(self) -> None:
        if self.joins_replicas and not self.joined:
            return  # join_data_parallel loads, once the world exists
        with _open_checkpoint(self.model_spec) as checkpoint:
            config = checkpoint.config
            self.model_config = config
            layers = pipeline_layers(config.num_hidden_layers, self.pp_size,
                                     self.pp_layer_partition)[self.pp_rank]
            share = rank_share(num_heads=config.num_attention_heads,
                               num_kv_heads=config.num_key_value_heads,
                               intermediate_size=config.intermediate_size,
                               vocab_size=config.vocab_size, layers=layers,
                               tp_rank=self.tp_rank, tp_size=self.tp_size)
            head_counts = dcp_head_counts(config.num_attention_heads,
                                          config.num_key_value_heads, self.tp_size,
                                          self.dcp_size, self.tp_rank)
            if self.expert_parallel and getattr(config, "moe", None) is None:
                raise ValueError("enable_expert_parallel needs a mixture-of-experts model; "
                                 f"{self.model_spec} is dense")
            max_len = self.max_model_len or config.max_position_embeddings
            self.max_model_len = max_len
            self.layer_range = layers
            self.kv_head_range = (share.attention.kv_start, share.attention.kv_stop)
            self.stage = load_stage(checkpoint, config, share, is_first=self.is_first_stage,
                                    is_last=self.is_last_stage, tp_group=self.tp_group,
                                    dtype=self.dtype, device=self.device, max_positions=max_len,
                                    dcp_group=self.dcp_group, dcp_head_counts=head_counts,
                                    expert_parallel=self.expert_parallel,
                                    ep_group=self.ep_group,
                                    # only experts across replicas gather over DP:
                                    # dense replicas in one world step on their own
                                    dp_group=self.dp_group if self.ep_across_replicas
                                    else None,
                                    quantization=self.quantization)
        experts = self.stage.experts_held()
        logger.info("rank %d (PP stage %d/%d) holds %s%s; %s on %s, weights %s", self.rank,
                    self.pp_rank, self.pp_size, share.describe(),
                    f", experts {experts}" if experts else "", self.dtype, self.device,
                    self.stage.packed)

    def _require_stage(self) -> LlamaStage:
        if self.stage is None:
            raise RuntimeError("load_model() has not run on this worker")
        return self.stage

    def kv_cache_block_bytes(self) -> int:
        stage = self._require_stage()
        return kv_block_bytes(num_layers=len(stage.layers), block_size=self.block_size,
                              num_kv_heads=stage.num_kv_heads, head_dim=stage.head_dim,
                              dtype=self.dtype)

    def determine_available_memory(self) -> int:
        return memory_budget(self.device, self.kv_cache_memory_bytes,
                             self.context.local_world_size)

    def initialize_cache(self, num_blocks: int) -> None:
        stage = self._require_stage()
        self.cache = KVCache(num_layers=len(stage.layers), num_blocks=num_blocks,
                             block_size=self.block_size, num_kv_heads=stage.num_kv_heads,
                             head_dim=stage.head_dim, dtype=self.dtype, device=self.device,
                             layer_range=self.layer_range, kv_head_range=self.kv_head_range)
        if self.connector is not None:
            self.connector.register_kv_caches(self.cache)
        logger.info("KV cache: %d blocks of %d tokens (%d MiB)", num_blocks, self.block_size,
                    num_blocks * self.kv_cache_block_bytes() >> 20)

    # -- one step ---------------------------------------------------------------------

    def _run_stage(self, token_ids: list[int], positions: list[int],
                   layout: list[ScheduledRequest], sample_rows: list[int],
                   cache: KVCache, argmax_only: bool = False,
                   split_rows: list[bool] | None = None) -> torch.Tensor | None:
        """This stage's forward; the logits of ``sample_rows`` on the last stage
        (``argmax_only``: exact where they decide each row's argmax, see
        ``ParallelLMHead``).  ``split_rows``: the rows whose activations packed
        weights split (``PreparedStep.split``; ``None``: every row)."""
        stage = self._require_stage()
        device = self.device
        batch: AttentionBatch | DcpBatch | PcpBatch
        split = split_step(len(token_ids), self.pcp_size)
        lo, hi = (0, len(token_ids)) if split is None else split[self.pcp_rank]
        if split is not None:
            whole = build_attention_batch(layout, self.block_size, device)
            batch = PcpBatch(build_attention_batch(rows_layout(layout, lo, hi), self.block_size,
                                                   device),
                             whole.slot_mapping, [b - a for a, b in split], self.pcp_group)
            token_ids, positions = token_ids[lo:hi], positions[lo:hi]
            split_rows = None if split_rows is None else split_rows[lo:hi]
            self.pcp_split_steps += 1
        elif self.dcp_size > 1:
            batch = build_dcp_batch(layout, self.block_size, self.dcp_size, self.dcp_rank, device)
        else:
            batch = build_attention_batch(layout, self.block_size, device)
        connector = self.connector if cache is self.cache else None
        if connector is not None:
            for index in range(len(stage.layers)):
                connector.wait_for_layer_load(index)
        position_tensor = torch.tensor(positions, dtype=torch.int64, device=device)
        # float weights take no rule: nothing per step for them
        rule = None if split_rows is None or stage.packed == "float" else \
            SplitRows(torch.tensor(split_rows, dtype=torch.bool, device=device))
        with splitting(rule):
            if self.is_first_stage:
                ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
                hidden, residual = stage.forward(positions=position_tensor, batch=batch,
                                                 cache=cache, token_ids=ids)
            else:
                received = self.pp_group.recv_tensor_dict(src=self.pp_group.rank_in_group - 1)
                hidden, residual = stage.forward(positions=position_tensor, batch=batch,
                                                 cache=cache, hidden=received["hidden"],
                                                 residual=received["residual"])
        if connector is not None:
            for index in range(len(stage.layers)):
                connector.save_kv_layer(index, cache.layer(index))
        if not self.is_last_stage:
            self.pp_group.send_tensor_dict({"hidden": hidden, "residual": residual},
                                           dst=self.pp_group.rank_in_group + 1)
            return None
        if split is None:
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=device)
            return stage.compute_logits(hidden, residual, rows, argmax_only)
        # each PCP rank computes the logits of the sampled rows it holds; all
        # of them, gathered in row order, go to every rank's sampler
        mine = torch.tensor([r - lo for r in sample_rows if lo <= r < hi], dtype=torch.int64,
                            device=device)
        counts = [sum(1 for r in sample_rows if a <= r < b) for a, b in split]
        vocab = self.model_config.vocab_size
        if not any(counts):
            return torch.empty((0, vocab), dtype=torch.float32, device=device)
        # a rank without sampled rows (its TP peers have none either) skips the head
        logits = (stage.compute_logits(hidden, residual, mine, argmax_only) if len(mine)
                  else torch.empty((0, vocab), dtype=torch.float32, device=device))
        return gather_rows(logits, self.pcp_group, counts)

    def _run_with_prompt_rows(self, step: PreparedStep, prompt_rows: list[int],
                              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits of the sampled rows and of the prompt-logprob rows.

        The stage computes them for the rows in ascending order (a PCP split
        gathers them rank by rank, i.e. in row order) and they are put back
        in request order here.
        """
        assert self.cache is not None
        rows = step.sample_rows + prompt_rows
        order = sorted(range(len(rows)), key=rows.__getitem__)
        logits = self._run_stage(step.token_ids, step.positions, step.layout,
                                 [rows[i] for i in order], self.cache, split_rows=step.split)
        if logits is None:
            return None, None
        inverse = torch.empty(len(order), dtype=torch.int64)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        logits = logits[inverse.to(logits.device)]
        count = len(step.sample_rows)
        return logits[:count], logits[count:]

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        started = time.perf_counter()
        if self.cache is None:
            raise RuntimeError("initialize_cache() has not run on this worker")
        self.requests.update(scheduler_output)
        step = self.requests.prepare(scheduler_output)
        if len(step.token_ids) > self.max_num_batched_tokens:
            raise ValueError(f"the step schedules {len(step.token_ids)} tokens; "
                             f"max_num_batched_tokens is {self.max_num_batched_tokens}")
        vocab = self.model_config.vocab_size
        if step.token_ids and not 0 <= min(step.token_ids) <= max(step.token_ids) < vocab:
            # checked here: a vocab-parallel lookup would turn it into a silent zero row
            bad = next(t for t in step.token_ids if not 0 <= t < vocab)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if step.positions and max(step.positions) >= (self.max_model_len or 0):
            raise ValueError(f"position {max(step.positions)} is beyond max_model_len "
                             f"{self.max_model_len}")
        logits = prompt_logits = None
        connector = self.connector
        if connector is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            connector.start_load_kv()
        if step.token_ids:
            prompt_rows = [row for p in step.prompt_logprobs for row in p.rows]
            if not prompt_rows:
                logits = self._run_stage(step.token_ids, step.positions, step.layout,
                                         step.sample_rows, self.cache,
                                         argmax_suffices(step.sample_requests), step.split)
            else:
                logits, prompt_logits = self._run_with_prompt_rows(step, prompt_rows)
        if connector is not None:
            connector.wait_for_save()
            connector.clear_connector_metadata()
        if self.is_last_stage:
            self.pending.append(PendingStep(step.sample_req_ids, step.sample_requests, logits,
                                            time.perf_counter() - started,
                                            step.prompt_logprobs, prompt_logits, step.drafts))

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        kv_output = None
        if self.connector is not None:
            sending, recving, invalid = self.connector.get_finished()
            kv_output = KVConnectorOutput(sending or None, recving or None, invalid or None)
        if not self.is_last_stage:
            return None if kv_output is None else ModelRunnerOutput(kv_connector_output=kv_output)
        started = time.perf_counter()
        if not self.pending:
            raise RuntimeError("sample_tokens() without a step from execute_model()")
        pending = self.pending.popleft()
        tokens: list[list[int]] = []
        logprobs: list[list[LogprobsRow] | None] | None = None
        if pending.logits is not None and pending.req_ids:
            allowed = self._grammar_mask(grammar_output, pending)
            row_tokens, row_logprobs = sample(pending.logits, pending.requests, allowed)
            tokens, logprobs = self._verify(pending.drafts, row_tokens, row_logprobs)
        self.requests.record_sampled(pending.req_ids, tokens, pending.drafts)
        self.last_sampled_req_ids = pending.req_ids
        if not self.is_output_rank:
            return None if kv_output is None else ModelRunnerOutput(kv_connector_output=kv_output)
        return ModelRunnerOutput(
            req_ids=list(pending.req_ids), sampled_token_ids=tokens,
            logprobs=logprobs, prompt_logprobs=self._prompt_logprobs(pending),
            kv_connector_output=kv_output,
            extra={"worker_execute_s": pending.execute_s,
                   "worker_sample_s": time.perf_counter() - started})

    @staticmethod
    def _verify(drafts: list[list[int]], row_tokens: list[int],
                row_logprobs: list[LogprobsRow | None] | None,
                ) -> tuple[list[list[int]], list[list[LogprobsRow] | None] | None]:
        """Per request, the tokens it emits (its rows' samples up to the first
        rejected draft) and their logprob rows."""
        tokens: list[list[int]] = []
        logprobs: list[list[LogprobsRow] | None] | None = \
            None if row_logprobs is None else []
        row = 0
        for proposed in drafts:
            emitted = spec_decode.accept(proposed, row_tokens[row:row + len(proposed) + 1])
            tokens.append(emitted)
            if logprobs is not None and row_logprobs is not None:
                rows = row_logprobs[row:row + len(emitted)]
                logprobs.append(None if rows[0] is None else
                                [r for r in rows if r is not None])
            row += len(proposed) + 1
        return tokens, logprobs

    @staticmethod
    def _prompt_logprobs(pending: PendingStep) -> dict[str, tuple[int, list[LogprobsRow]]]:
        if pending.prompt_logits is None:
            return {}
        targets = [t for p in pending.prompt_rows for t in p.targets]
        top_k = [p.top_k for p in pending.prompt_rows for _ in p.rows]
        rows = iter(logprob_rows(pending.prompt_logits, targets, top_k))
        return {p.req_id: (p.first_position, [next(rows) for _ in p.rows])
                for p in pending.prompt_rows}

    def _grammar_mask(self, grammar_output: GrammarOutput | None,
                      pending: PendingStep) -> torch.Tensor | None:
        if grammar_output is None or not grammar_output.structured_output_request_ids:
            return None
        assert pending.logits is not None
        vocab = pending.logits.shape[-1]
        bitmask = grammar_output.grammar_bitmask
        if isinstance(bitmask, (bytes, bytearray, array.array)):  # the engine sends array('i')
            count = len(grammar_output.structured_output_request_ids)
            bitmask = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).reshape(count, -1)
        rows = unpack_bitmask(bitmask, vocab, pending.logits.device)
        allowed = torch.ones_like(pending.logits, dtype=torch.bool)
        # a constrained request has one row (it never carries drafts): its last
        first_rows = list(itertools.accumulate((len(d) + 1 for d in pending.drafts), initial=0))
        index = {req_id: first + len(d) for req_id, first, d in
                 zip(pending.req_ids, first_rows[:-1], pending.drafts, strict=True)}
        for row, req_id in enumerate(grammar_output.structured_output_request_ids):
            if req_id in index:
                allowed[index[req_id]] = rows[row]
        return allowed

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """n-gram prompt-lookup proposals (``speculative_config``) for the
        requests that just sampled, from their histories with what they emitted."""
        if not self.is_output_rank:
            return None
        drafts = DraftTokenIds()
        for req_id in self.last_sampled_req_ids:
            state = self.requests.requests.get(req_id)
            if state is not None:
                drafts.req_ids.append(req_id)
                drafts.draft_token_ids.append(self.speculative.propose(state.token_ids))
        return drafts

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """A real one-token forward through every stage, written to the scratch block."""
        stage = self._require_stage()
        cache = self.cache or KVCache(num_layers=len(stage.layers), num_blocks=1,
                                      block_size=self.block_size,
                                      num_kv_heads=stage.num_kv_heads,
                                      head_dim=stage.head_dim, dtype=self.dtype,
                                      device=self.device)
        layout = [ScheduledRequest([cache.scratch_block], 0, 1)]
        self._run_stage([0], [0], layout, [0], cache)

    # -- profiling ------------------------------------------------------------------

    def start_profile(self, trace_dir: str | None = None) -> None:
        """Time the model's marked phases from now on (:mod:`mpexec.models.profiling`);
        with ``trace_dir``, also record a torch profiler trace there."""
        profiling.start(trace_dir)

    def stop_profile(self) -> profiling.ProfileSummary:
        """Stop timing; this rank's totals since :meth:`start_profile`."""
        return profiling.stop(self.rank)

    # -- health and the end -----------------------------------------------------------

    def check_health(self) -> None:
        """The device computes, and the TP group completes a tiny all-reduce in time."""
        probe = torch.ones(1, device=self.device)
        if float((probe + probe).sum()) != 2.0:
            raise RuntimeError(f"device {self.device} computed 1 + 1 != 2")
        if self.tp_group is None or self.tp_group.world_size == 1:
            return
        result: list[float] = []
        thread = threading.Thread(
            target=lambda: result.append(float(self.tp_group.all_reduce(probe.clone()).sum())),
            name="mpexec-health", daemon=True)
        thread.start()
        deadline = self.config.check_health_timeout_s / 2
        thread.join(deadline)
        if thread.is_alive() or not result:
            raise TimeoutError(f"TP all-reduce did not complete within {deadline:.1f} s")
        if result[0] != self.tp_group.world_size:
            raise RuntimeError(f"TP all-reduce of ones gave {result[0]}, expected "
                               f"{self.tp_group.world_size}")

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.close()
        self.cache = None
        self.stage = None
        self.pending.clear()
        if self.detached_dp:
            from mpexec import distributed

            detached = distributed.set_dp_group(None)
            if detached is not None:
                detached.close()
        if self.owns_distributed:
            from mpexec import distributed

            self.owns_distributed = False
            distributed.destroy_model_parallel()
            distributed.destroy_distributed_environment()
