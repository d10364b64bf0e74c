"""Grouped-query attention over the paged KV cache, on this rank's heads.

Per layer and step::

    qkv = hidden @ [Wq; Wk; Wv]_local.T        (column-parallel, one matmul)
    q, k = rotate(q), rotate(k)
    K[slot_mapping], V[slot_mapping] = k, v    (write the new tokens first)
    decode rows:  q as [B, kv_heads, group, d] against the gathered [B, kv_heads, L, d]
                  (a query group shares its KV head, so no KV copy per query head);
                  rows of differing lengths (and a decode token with its drafts)
                  one by one, each over exactly its own context
    prefill rows: causal SDPA over the chunk, or over the gathered context
    out = attn @ Wo_local.T, all-reduced     (row-parallel)

Each rank attends only with its own query heads and the KV heads they use;
nothing crosses ranks until ``o_proj``'s all-reduce.

Options some families need: ``q_norm``/``k_norm`` (an RMSNorm over each
query / key head before the rotation: Qwen3, Gemma 3), ``scale`` (the
softmax scale, default ``1/√head_dim``), ``softcap`` (scores become
``cap · tanh(scores / cap)`` before the mask: Gemma 2; SDPA cannot do this,
so such a layer attends with explicit matmuls).  A sliding-window layer is
handed a batch whose masks already cut the window (``AttentionBatch.windowed``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpexec.models.context_parallel import DcpBatch, DcpGroup, dcp_attention
from mpexec.models.kv_cache import AttentionBatch
from mpexec.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpexec.models.layers.norm import RMSNorm
from mpexec.models.layers.rotary import RotaryEmbedding
from mpexec.models.prefill_parallel import PcpBatch, write_all_rows


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           mask: torch.Tensor | None = None, causal: bool = False, scale: float | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """SDPA over ``[..., heads, q, d]`` queries and ``[..., kv_heads, L, d]`` keys
    (grouped heads allowed); with ``softcap``, the same in explicit matmuls."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale,
                                              enable_gqa=k.shape[-3] != q.shape[-3])
    if k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None
                                                     else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                          device=q.device).tril(k.shape[-2] - q.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


class Attention:
    def __init__(self, *, qkv_proj: ColumnParallelLinear, o_proj: RowParallelLinear,
                 num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None, scale: float | None = None,
                 softcap: float | None = None, dcp: DcpGroup | None = None,
                 dcp_head_counts: list[int] | None = None) -> None:
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.rotary = rotary
        # decode context parallelism (``context_parallel``): the group, and
        # the query heads each of its ranks holds
        self.dcp = dcp
        self.dcp_head_counts = dcp_head_counts or [num_heads]
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.scale = scale
        self.softcap = softcap

    def __call__(self, hidden: torch.Tensor, batch: AttentionBatch | DcpBatch | PcpBatch,
                 rope: tuple[torch.Tensor, torch.Tensor],
                 cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k sit side by side in qkv: one rotation covers both
        qk = qkv[:, :self.q_size + self.kv_size].view(
            tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm.normalize(q), self.k_norm.normalize(k)), dim=1)
        qk = self.rotary.apply(qk, *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if isinstance(batch, PcpBatch):
            # every row's K/V into the cache first; then this rank's rows attend
            # as a batch of their own over it
            write_all_rows(batch, k, v, cache)
            batch = batch.inner
        if isinstance(batch, DcpBatch):
            assert self.dcp is not None, "a DCP batch reached a layer built without DCP"
            scale = self.head_dim ** -0.5 if self.scale is None else self.scale
            return self.o_proj(dcp_attention(q, k, v, batch, cache, self.dcp,
                                             self.dcp_head_counts, scale))
        k_cache, v_cache = cache
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        if not batch.prefills and batch.decode_rows is None:
            out = self._decode(q, batch, k_cache, v_cache)
        else:
            out = torch.empty((tokens, self.q_size), dtype=q.dtype, device=q.device)
            if batch.decode_slots is not None:
                rows = batch.decode_rows
                assert rows is not None
                out[rows] = self._decode(q[rows], batch, k_cache, v_cache)
            for span in batch.prefills:
                rows_q = q[span.start:span.stop]
                if span.context_slots is None:
                    keys, values = k[span.start:span.stop], v[span.start:span.stop]
                else:
                    keys = torch.index_select(k_cache, 0, span.context_slots)
                    values = torch.index_select(v_cache, 0, span.context_slots)
                out[span.start:span.stop] = self._prefill(rows_q, keys, values, span.mask)
        return self.o_proj(out)

    def _decode(self, q: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        assert batch.decode_slots is not None
        count = q.shape[0]
        # [C, L, kv, d] -> [C, kv, L, d]; the group of query heads of one KV
        # head plays the part of the query length.
        # index_select over flat slots: several times faster than advanced
        # indexing with a 2-D index on the CPU
        flat = batch.decode_slots.view(-1)
        shape = (batch.decode_slots.shape[0], batch.decode_slots.shape[1], self.num_kv_heads,
                 self.head_dim)
        keys = torch.index_select(k_cache, 0, flat).view(shape).transpose(1, 2)
        values = torch.index_select(v_cache, 0, flat).view(shape).transpose(1, 2)
        queries = q.view(count, self.num_kv_heads, self.group, self.head_dim)
        if batch.decode_split is None:  # one context per row, all of one length
            out = attend(queries, keys, values, mask=batch.decode_mask, scale=self.scale,
                         softcap=self.softcap)
            return out.reshape(count, self.q_size)
        # Each row over exactly its own context, as the one call of a batch of
        # one would make it: the same shapes give the same numbers (a masked,
        # padded batch sums in another order).  One call per row also costs
        # less here than the masked batch.
        out = torch.empty((count, self.q_size), dtype=q.dtype, device=q.device)
        for row, (context, length) in enumerate(batch.decode_split):
            mask = None if batch.window is None or batch.decode_mask is None \
                else batch.decode_mask[row:row + 1, :, :, :length]
            out[row] = attend(queries[row:row + 1], keys[context:context + 1, :, :length],
                              values[context:context + 1, :, :length], mask=mask,
                              scale=self.scale, softcap=self.softcap).reshape(self.q_size)
        return out

    def _prefill(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        count = q.shape[0]
        queries = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        out = attend(queries, keys, values, mask=mask, causal=mask is None, scale=self.scale,
                     softcap=self.softcap)
        return out[0].transpose(0, 1).reshape(count, self.q_size)
