"""The Llama-family decoder, as one pipeline stage of one tensor-parallel rank.

::

    first stage:   token ids ── VocabParallelEmbedding ──┐
                                                           ▼
    every stage:   (hidden, residual) ── layers[start:stop] ── (hidden, residual)
                                                           │ send_tensor_dict → next stage
    last stage:    rows that sample ── RMSNorm ── ParallelLMHead ── float32 logits [n, vocab]

A layer is RMSNorm → attention (q/k/v column-parallel, optional q/k/v
biases as in Qwen2, rotary, GQA over the paged cache, o_proj row-parallel)
→ RMSNorm → SwiGLU MLP (gate/up column-parallel, down row-parallel).
:func:`load_stage` builds a stage from a checkpoint, reading only this
rank's slices (``Checkpoint.read(name, dim, start, stop)``).  The model
holds no per-request state; the worker owns requests and the KV cache.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mpexec.models.context_parallel import DcpBatch, DcpGroup
from mpexec.models.kv_cache import AttentionBatch, KVCache
from mpexec.models.layers.attention import Attention
from mpexec.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mpexec.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpexec.models.layers.norm import RMSNorm
from mpexec.models.layers.parallel import ParallelGroup
from mpexec.models.layers.rotary import RotaryEmbedding, rope_type_of
from mpexec.models.prefill_parallel import PcpBatch
from mpexec.models.sharding import RankShare

# ModelConfig names the family ("llama" covers Mistral and SmolLM).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class CheckpointReader(Protocol):
    """What the model needs of a checkpoint (``mpexec.models.loader``'s ``Checkpoint``)."""

    def names(self) -> Any: ...

    def read(self, name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


def head_dim_of(config: Any) -> int:
    """The head size: the config's, which need not be hidden_size / heads."""
    return int(config.head_dim)


def check_supported(config: Any) -> None:
    """Raise ValueError naming the field when the model cannot run this config."""
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    rope_type_of(config.rope_scaling)
    if head_dim_of(config) % 2:
        raise ValueError(f"head_dim ({head_dim_of(config)}) must be even for rotary embeddings")


class DecoderLayer:
    def __init__(self, *, input_norm: RMSNorm, attention: Attention, post_norm: RMSNorm,
                 gate_up: ColumnParallelLinear, down: RowParallelLinear) -> None:
        self.input_norm = input_norm
        self.attention = attention
        self.post_norm = post_norm
        self.gate_up = gate_up
        self.down = down

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                 batch: AttentionBatch | DcpBatch | PcpBatch,
                 rope: tuple[torch.Tensor, torch.Tensor],
                 cache: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_norm(hidden, residual)
        hidden = self.attention(hidden, batch, rope, cache)
        hidden, residual = self.post_norm(hidden, residual)
        gate, up = self.gate_up(hidden).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), residual


class LlamaStage:
    """Layers ``share.layers`` of the model, with embedding / head where they belong."""

    def __init__(self, *, share: RankShare, layers: list[DecoderLayer],
                 embedding: VocabParallelEmbedding | None, final_norm: RMSNorm | None,
                 lm_head: ParallelLMHead | None, rotary: RotaryEmbedding,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.share = share
        self.layers = layers
        self.embedding = embedding
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.rotary = rotary
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device

    @property
    def is_first(self) -> bool:
        return self.embedding is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def forward(self, *, positions: torch.Tensor,
                batch: AttentionBatch | DcpBatch | PcpBatch, cache: KVCache,
                token_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this stage: from token ids (first stage) or the previous stage's
        ``(hidden, residual)``; returns this stage's ``(hidden, residual)``."""
        if self.embedding is not None:
            assert token_ids is not None
            hidden, residual = self.embedding(token_ids), None
        assert hidden is not None
        rope = self.rotary.lookup(positions)
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, batch, rope, cache.layer(index))
        assert residual is not None
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor,
                       rows: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[len(rows), vocab]`` of the chosen rows (last stage)."""
        assert self.final_norm is not None and self.lm_head is not None
        normed, _ = self.final_norm(hidden[rows], residual[rows])
        return self.lm_head(normed)


def load_stage(checkpoint: CheckpointReader, config: Any, share: RankShare, *,
               is_first: bool, is_last: bool, tp_group: ParallelGroup, dtype: torch.dtype,
               device: torch.device, max_positions: int, dcp_group: DcpGroup | None = None,
               dcp_head_counts: list[int] | None = None) -> LlamaStage:
    """Build this rank's stage, reading only its slices of the checkpoint; with
    ``dcp_group``, attention is decode-context-parallel (``context_parallel``)."""
    check_supported(config)
    names = set(checkpoint.names())
    head_dim = head_dim_of(config)
    tp = share.tp_size

    def read(name: str, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        if tp == 1:
            dim, start, stop = None, 0, None  # whole tensor: one contiguous read
        return checkpoint.read(name, dim=dim, start=start, stop=stop,
                               dtype=dtype).to(device).contiguous()

    def optional(name: str, dim: int | None = None, start: int = 0,
                 stop: int | None = None) -> torch.Tensor | None:
        return read(name, dim, start, stop) if name in names else None

    attn = share.attention
    q_rows = (attn.q_start * head_dim, attn.q_stop * head_dim)
    kv_rows = (attn.kv_start * head_dim, attn.kv_stop * head_dim)
    mlp_rows = share.intermediate
    rotary = RotaryEmbedding(head_dim=head_dim, rope_theta=config.rope_theta,
                             rope_scaling=config.rope_scaling,
                             max_position_embeddings=config.max_position_embeddings,
                             max_positions=max_positions, dtype=dtype, device=device)
    layers = []
    for index in range(*share.layers):
        prefix = f"model.layers.{index}."
        attn_prefix = prefix + "self_attn."
        qkv_weight = torch.cat([
            read(attn_prefix + "q_proj.weight", 0, *q_rows),
            read(attn_prefix + "k_proj.weight", 0, *kv_rows),
            read(attn_prefix + "v_proj.weight", 0, *kv_rows)])
        biases = [optional(attn_prefix + f"{p}_proj.bias", 0, *rows)
                  for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
        qkv_bias = None
        if any(b is not None for b in biases):
            if any(b is None for b in biases):
                raise ValueError(f"{attn_prefix}: q/k/v biases must be all present or all absent")
            qkv_bias = torch.cat([b for b in biases if b is not None])
        attention = Attention(
            qkv_proj=ColumnParallelLinear(qkv_weight, qkv_bias),
            o_proj=RowParallelLinear(read(attn_prefix + "o_proj.weight", 1, *q_rows), tp_group,
                                     bias=optional(attn_prefix + "o_proj.bias")),
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=head_dim,
            rotary=rotary, dcp=dcp_group, dcp_head_counts=dcp_head_counts)
        mlp_prefix = prefix + "mlp."
        gate_up = torch.cat([read(mlp_prefix + "gate_proj.weight", 0, *mlp_rows),
                             read(mlp_prefix + "up_proj.weight", 0, *mlp_rows)])
        layers.append(DecoderLayer(
            input_norm=RMSNorm(read(prefix + "input_layernorm.weight"), config.rms_norm_eps),
            attention=attention,
            post_norm=RMSNorm(read(prefix + "post_attention_layernorm.weight"),
                              config.rms_norm_eps),
            gate_up=ColumnParallelLinear(gate_up),
            down=RowParallelLinear(read(mlp_prefix + "down_proj.weight", 1, *mlp_rows),
                                   tp_group)))
    vocab_start, vocab_stop = share.vocab
    embedding = lm_head = final_norm = None
    embed_rows: torch.Tensor | None = None
    if is_first:
        embed_rows = read("model.embed_tokens.weight", 0, vocab_start, vocab_stop)
        embedding = VocabParallelEmbedding(embed_rows, vocab_start, tp_group)
    if is_last:
        final_norm = RMSNorm(read("model.norm.weight"), config.rms_norm_eps)
        if not config.tie_word_embeddings and "lm_head.weight" in names:
            head = read("lm_head.weight", 0, vocab_start, vocab_stop)
        elif embed_rows is not None:
            head = embed_rows  # tied: the same rows serve both ends
        else:
            head = read("model.embed_tokens.weight", 0, vocab_start, vocab_stop)
        lm_head = ParallelLMHead(head, tp_group)
    return LlamaStage(share=share, layers=layers, embedding=embedding, final_norm=final_norm,
                      lm_head=lm_head, rotary=rotary, num_kv_heads=attn.num_kv_heads,
                      head_dim=head_dim, dtype=dtype, device=device)
