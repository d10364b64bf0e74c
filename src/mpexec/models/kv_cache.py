"""The paged KV cache: a pool of blocks, and where each step's tokens go.

Memory::

    cache[layer] = (K, V), each [(num_blocks + 1) * block_size, local KV heads, head_dim]

A *slot* is one position of one block: the token at position ``p`` of a
request whose block table is ``blocks`` lives in slot ``blocks[p //
block_size] * block_size + p % block_size``.  The block tables come from
the scheduler (``NewRequestData.block_ids``, extended by
``SchedulerOutput.new_block_ids``); the block after the last one the
scheduler may hand out is this worker's scratch block, where the warm-up
batch writes.

Per step, :func:`build_attention_batch` turns the scheduled requests into
one :class:`AttentionBatch` that every layer shares:

- ``slot_mapping`` ``[T]``: where each new token's K/V is written;
- the decode rows (one new token each) attend over their cached slots
  (``decode_slots`` ``[C, L]``, one context per decode request, padding
  pointing at the request's own first slot so no uninitialised memory is
  ever read); rows of one length attend as one batch, rows of differing
  lengths each over exactly its own context (``decode_split``), so a row's
  numbers never depend on what else is in the batch;
- a *verified* chunk (``ScheduledRequest.verify``: a decode token and its
  draft tokens) attends as decode rows too, row ``j`` over the first
  ``start + 1 + j`` slots of the request's one context: each row computes
  exactly what a plain one-token decode step at that position would, so
  drafts never change a greedy choice (a masked multi-row attention sums in
  another order, and a difference in the last bit is enough to flip a
  bfloat16 rounding downstream);
- each prefill chunk attends on its own: causally over its own K/V when it
  is the whole context (``context_slots is None``), else over the gathered
  context with a mask that lets query ``i`` see positions up to
  ``num_computed + i``.

Sizing: :func:`kv_block_bytes` is what one block costs on this worker,
:func:`memory_budget` what the worker can give the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

# Share of the memory a worker finds free that it offers to its KV cache
# when no explicit budget is given (the rest stays for activations and the
# other processes of the machine).
CPU_FREE_MEMORY_FRACTION = 0.25
CUDA_FREE_MEMORY_FRACTION = 0.85


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a step: its block table and where its tokens go."""

    block_ids: list[int]
    start: int  # position of the first new token (tokens already cached)
    num_tokens: int
    verify: bool = False  # a decode token and its drafts: each row attends as a decode row


@dataclass
class PrefillSpan:
    start: int  # rows [start, stop) of the step's tokens
    stop: int
    context_slots: torch.Tensor | None  # [L]; None: the chunk is the whole context
    mask: torch.Tensor | None  # [q, L] bool, True = may attend
    position: int = 0  # position of the chunk's first token (its context is 0..)


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None  # None: every row is a decode row, in order
    decode_slots: torch.Tensor | None  # [C, L]: one context per decode request
    decode_mask: torch.Tensor | None  # [B, 1, 1, L]; None when no padding
    prefills: list[PrefillSpan]
    num_tokens: int
    decode_lengths: torch.Tensor | None = None  # [B] context length of each decode row
    # per decode row (its context in decode_slots, its length); None when
    # every row is its own context and all have one length (one batched call)
    decode_split: list[tuple[int, int]] | None = None
    window: int | None = None  # the sliding window decode_mask cuts (windowed())

    def windowed(self, window: int) -> AttentionBatch:
        """The same batch for a sliding-window layer: a query at position ``p``
        sees the keys at positions ``p - window + 1 … p`` only."""
        decode_mask = self.decode_mask
        if self.decode_slots is not None:
            assert self.decode_lengths is not None
            keys = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)
            lengths = self.decode_lengths.unsqueeze(1)
            decode_mask = ((keys < lengths) & (keys >= lengths - window))[:, None, None, :]
        prefills = []
        for span in self.prefills:
            count = span.stop - span.start
            queries = torch.arange(span.position, span.position + count).unsqueeze(1)
            first_key = 0 if span.context_slots is not None else span.position
            keys = torch.arange(first_key, span.position + count).unsqueeze(0)
            mask = (keys <= queries) & (keys > queries - window)
            device = span.mask.device if span.mask is not None else self.slot_mapping.device
            prefills.append(PrefillSpan(span.start, span.stop, span.context_slots,
                                        mask.to(device), span.position))
        return AttentionBatch(self.slot_mapping, self.decode_rows, self.decode_slots,
                              decode_mask, prefills, self.num_tokens, self.decode_lengths,
                              self.decode_split, window)


def _slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return blocks[positions // block_size] * block_size + positions % block_size


def build_attention_batch(requests: list[ScheduledRequest], block_size: int,
                          device: torch.device) -> AttentionBatch:
    slot_parts = []
    decode_rows: list[int] = []
    decode_contexts: list[torch.Tensor] = []
    split: list[tuple[int, int]] = []  # per decode row: (its context, its length)
    prefills = []
    row = 0
    for request in requests:
        end = request.start + request.num_tokens
        if end > len(request.block_ids) * block_size:
            raise ValueError(
                f"a request reaches position {end - 1} but its block table holds "
                f"{len(request.block_ids)} blocks of {block_size}")
        blocks = torch.tensor(request.block_ids, dtype=torch.int64)
        context = _slots(blocks, torch.arange(end), block_size)
        slot_parts.append(context[request.start:])
        if request.start > 0 and (request.num_tokens == 1 or request.verify):
            for offset in range(request.num_tokens):
                decode_rows.append(row + offset)
                split.append((len(decode_contexts), request.start + 1 + offset))
            decode_contexts.append(context)
        elif request.start == 0:
            prefills.append(PrefillSpan(row, row + request.num_tokens, None, None))
        else:
            query_positions = torch.arange(request.start, end).unsqueeze(1)
            mask = torch.arange(end).unsqueeze(0) <= query_positions
            prefills.append(PrefillSpan(row, row + request.num_tokens,
                                        context.to(device), mask.to(device), request.start))
        row += request.num_tokens
    decode_slots = decode_mask = rows = decode_lengths = None
    decode_split = None
    if decode_contexts:
        row_lengths = [length for _, length in split]
        decode_lengths = torch.tensor(row_lengths, device=device)
        longest = max(len(c) for c in decode_contexts)
        padded = torch.stack([torch.cat((c, c[:1].expand(longest - len(c)))) if len(c) < longest
                              else c for c in decode_contexts])
        decode_slots = padded.to(device)
        if min(row_lengths) < longest:
            valid = torch.arange(longest).unsqueeze(0) < torch.tensor(row_lengths).unsqueeze(1)
            decode_mask = valid[:, None, None, :].to(device)
        if decode_mask is not None or len(decode_contexts) != len(split):
            decode_split = split
        if len(decode_rows) != row:
            rows = torch.tensor(decode_rows, dtype=torch.int64, device=device)
    slot_mapping = torch.cat(slot_parts).to(device) if slot_parts else torch.empty(
        0, dtype=torch.int64, device=device)
    return AttentionBatch(slot_mapping, rows, decode_slots, decode_mask, prefills, row,
                          decode_lengths, decode_split)


class KVCache:
    """``num_blocks`` usable blocks (plus the scratch block) for every local layer."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, layer_range: tuple[int, int] | None = None,
                 kv_head_range: tuple[int, int] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # which of the model's layers and KV heads this cache holds (KV connectors
        # exchanging blocks between different layouts need it)
        self.layer_range = layer_range or (0, num_layers)
        self.kv_head_range = kv_head_range or (0, num_kv_heads)
        slots = (num_blocks + 1) * block_size
        # Not zeroed: a slot is always written before it is read (see module
        # docstring), and untouched pages of a large CPU allocation stay free.
        self.tensor = torch.empty((num_layers, 2, slots, num_kv_heads, head_dim),
                                  dtype=dtype, device=device)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensor[index, 0], self.tensor[index, 1]


def kv_block_bytes(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """Bytes one block costs on a worker that holds ``num_layers`` layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def free_host_memory() -> int:
    """Bytes this process can still allocate: MemAvailable, capped by the
    cgroup's limit minus its usage (v2 or v1) when one applies."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        limit = _read_int(Path("/sys/fs/cgroup") / limit_file)
        usage = _read_int(Path("/sys/fs/cgroup") / usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            available = min(available, max(limit - usage, 0))
    return available


def memory_budget(device: torch.device, explicit_bytes: int | None,
                  local_world_size: int) -> int:
    """Bytes this worker offers its KV cache: ``explicit_bytes`` when set,
    else a share of the free device memory (CPU: split among the node's
    workers, which draw on the same RAM)."""
    if explicit_bytes is not None:
        return int(explicit_bytes)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_MEMORY_FRACTION)
    return int(free_host_memory() * CPU_FREE_MEMORY_FRACTION / max(local_world_size, 1))
