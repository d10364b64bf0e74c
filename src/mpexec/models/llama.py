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
The departures of Qwen3, Gemma 2/3 and Phi-3 (``ModelConfig.features``,
see ``arch_config``) are options of the same pieces: q/k norms, norms after
attention and after the MLP, a GELU-tanh MLP, scaled embeddings, soft-capped
scores and logits, sliding-window layers with a rotation of their own.
On the sparse layers of a mixture-of-experts config (Mixtral, Qwen2/3-MoE,
``ModelConfig.moe``) a :class:`~mpexec.models.layers.moe.MoEBlock` replaces
the MLP (``mpexec.models.moe`` says which experts a rank holds, split
tensor- or expert-parallel).
:func:`load_stage` builds a stage from a checkpoint, reading only this
rank's slices (``Checkpoint.read(name, dim, start, stop)``).  The model
holds no per-request state; the worker owns requests and the KV cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mpexec.models.arch_config import ArchFeatures
from mpexec.models.context_parallel import DcpBatch, DcpGroup
from mpexec.models.kv_cache import AttentionBatch, KVCache
from mpexec.models.layers.attention import Attention
from mpexec.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mpexec.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpexec.models.layers.moe import MoEBlock
from mpexec.models.layers.norm import RMSNorm
from mpexec.models.layers.parallel import ParallelGroup
from mpexec.models.layers.rotary import RotaryEmbedding, rope_type_of
from mpexec.models.moe import expert_share, load_moe_block
from mpexec.models.prefill_parallel import PcpBatch
from mpexec.models.quantization import WeightBuilder
from mpexec.models.sharding import RankShare

# ModelConfig names the family ("llama" covers Mistral and SmolLM).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


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
    """``post_norm`` is the norm before the MLP; Gemma's sandwich adds
    ``attn_out_norm`` (on the attention's output) and ``mlp_out_norm``."""

    def __init__(self, *, input_norm: RMSNorm, attention: Attention, post_norm: RMSNorm,
                 gate_up: ColumnParallelLinear | None = None,
                 down: RowParallelLinear | None = None,
                 attn_out_norm: RMSNorm | None = None, mlp_out_norm: RMSNorm | None = None,
                 activation: str = "silu", window: int | None = None,
                 rope_index: int = 0, moe: MoEBlock | None = None) -> None:
        self.input_norm = input_norm
        self.attention = attention
        self.post_norm = post_norm
        self.gate_up = gate_up
        self.down = down
        self.attn_out_norm = attn_out_norm
        self.mlp_out_norm = mlp_out_norm
        self.act = ACTIVATIONS[activation]
        self.window = window  # None: attends to the whole context
        self.rope_index = rope_index  # which of the stage's rotations
        self.moe = moe  # instead of gate_up/down on a sparse layer

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                 batch: AttentionBatch | DcpBatch | PcpBatch,
                 rope: tuple[torch.Tensor, torch.Tensor],
                 cache: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_norm(hidden, residual)
        hidden = self.attention(hidden, batch, rope, cache)
        if self.attn_out_norm is not None:
            hidden = self.attn_out_norm.normalize(hidden)
        hidden, residual = self.post_norm(hidden, residual)
        if self.moe is not None:
            hidden = self.moe(hidden)
        else:
            assert self.gate_up is not None and self.down is not None
            gate, up = self.gate_up(hidden).chunk(2, dim=-1)
            hidden = self.down(self.act(gate) * up)
        if self.mlp_out_norm is not None:
            hidden = self.mlp_out_norm.normalize(hidden)
        return hidden, residual


class LlamaStage:
    """Layers ``share.layers`` of the model, with embedding / head where they belong."""

    def __init__(self, *, share: RankShare, layers: list[DecoderLayer],
                 embedding: VocabParallelEmbedding | None, final_norm: RMSNorm | None,
                 lm_head: ParallelLMHead | None, rotary: RotaryEmbedding,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, rotaries: list[RotaryEmbedding] | None = None,
                 embedding_scale: float | None = None,
                 final_logit_softcapping: float | None = None, packed: str = "float") -> None:
        self.share = share
        self.layers = layers
        self.embedding = embedding
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.rotary = rotary
        self.rotaries = rotaries or [rotary]  # layer.rope_index indexes these
        self.embedding_scale = embedding_scale
        self.final_logit_softcapping = final_logit_softcapping
        self.packed = packed  # what load_stage kept packed, e.g. "int4 ×60, int8 ×1"
        self.windows = sorted({layer.window for layer in layers if layer.window})
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
            if self.embedding_scale is not None:  # Gemma: × √hidden, in the compute dtype
                hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        assert hidden is not None
        ropes = [rotary.lookup(positions) for rotary in self.rotaries]
        batches = {window: _windowed(batch, window) for window in self.windows}
        for index, layer in enumerate(self.layers):
            layer_batch = batches[layer.window] if layer.window else batch
            hidden, residual = layer(hidden, residual, layer_batch, ropes[layer.rope_index],
                                     cache.layer(index))
        assert residual is not None
        return hidden, residual

    def experts_held(self) -> str:
        """``[start, stop)`` of the experts this rank holds ("" for a dense model)."""
        for layer in self.layers:
            if layer.moe is not None:
                start = layer.moe.expert_start
                return f"[{start}, {start + layer.moe.num_local})"
        return ""

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor,
                       rows: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """float32 logits ``[len(rows), vocab]`` of the chosen rows (last stage);
        ``argmax_only``: exact only where they decide each row's argmax
        (``ParallelLMHead``)."""
        assert self.final_norm is not None and self.lm_head is not None
        normed, _ = self.final_norm(hidden[rows], residual[rows])
        logits = self.lm_head(normed, argmax_only)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def _windowed(batch: AttentionBatch | DcpBatch | PcpBatch,
              window: int) -> AttentionBatch | DcpBatch | PcpBatch:
    """The step's batch for the layers that attend over ``window`` tokens."""
    if isinstance(batch, PcpBatch):
        return dataclasses.replace(batch, inner=batch.inner.windowed(window))
    if isinstance(batch, DcpBatch):  # load_stage refuses this combination
        raise ValueError("decode context parallelism cannot run sliding-window layers")
    return batch.windowed(window)


def load_stage(checkpoint: CheckpointReader, config: Any, share: RankShare, *,
               is_first: bool, is_last: bool, tp_group: ParallelGroup, dtype: torch.dtype,
               device: torch.device, max_positions: int, dcp_group: DcpGroup | None = None,
               dcp_head_counts: list[int] | None = None, expert_parallel: bool = False,
               ep_group: ParallelGroup | None = None,
               dp_group: ParallelGroup | None = None,
               quantization: str = "none") -> LlamaStage:
    """Build this rank's stage, reading only its slices of the checkpoint; with
    ``dcp_group``, attention is decode-context-parallel (``context_parallel``).

    ``expert_parallel``: the MoE blocks split whole experts across the TP
    group instead of every expert's rows (``mpexec.models.moe``); with
    ``ep_group`` and ``dp_group`` (an EP group spanning data parallel
    replicas) across the EP group, the tokens gathered over the DP group.

    ``quantization="auto"`` keeps quantised linears and vocabulary rows packed
    (``mpexec.models.quantization``); ``"none"`` dequantises them to ``dtype``."""
    check_supported(config)
    names = set(checkpoint.names())
    head_dim = head_dim_of(config)
    tp = share.tp_size

    weights = WeightBuilder(checkpoint, quantization=quantization, dtype=dtype, device=device,
                            whole=tp == 1)  # one rank: whole tensors, one contiguous read
    read = weights.read

    def optional(name: str, dim: int | None = None, start: int = 0,
                 stop: int | None = None) -> torch.Tensor | None:
        return read(name, dim, start, stop) if name in names else None

    features = getattr(config, "features", None) or ArchFeatures()
    if dcp_group is not None and (features.sliding_window or features.attn_logit_softcapping):
        raise ValueError(f"decode context parallelism does not support {config.architecture}'s "
                         "sliding-window layers or attention soft-capping "
                         "(sliding_window, attn_logit_softcapping)")

    def norm(name: str) -> RMSNorm:
        weight = read(name)
        if features.norm_offset:  # Gemma: the norm scales by 1 + w
            weight = (weight.float() + features.norm_offset).to(dtype)
        return RMSNorm(weight, config.rms_norm_eps)

    attn = share.attention
    q_rows = (attn.q_start * head_dim, attn.q_stop * head_dim)
    kv_rows = (attn.kv_start * head_dim, attn.kv_stop * head_dim)
    mlp_rows = share.intermediate
    rotary = RotaryEmbedding(head_dim=head_dim, rope_theta=config.rope_theta,
                             rope_scaling=config.rope_scaling,
                             max_position_embeddings=config.max_position_embeddings,
                             max_positions=max_positions, dtype=dtype, device=device,
                             freq_factors=features.rope_freq_factors)
    rotaries = [rotary]
    if features.sliding_layers and features.local_rope_theta is not None:
        rotaries.append(RotaryEmbedding(  # Gemma 3's sliding layers: own base, no scaling
            head_dim=head_dim, rope_theta=features.local_rope_theta, rope_scaling=None,
            max_position_embeddings=config.max_position_embeddings,
            max_positions=max_positions, dtype=dtype, device=device))
    moe = getattr(config, "moe", None)
    experts = None
    if moe is not None and ep_group is not None:
        experts = expert_share(moe, ep_group.rank_in_group, ep_group.world_size, True)
    elif moe is not None:
        experts = expert_share(moe, share.tp_rank, share.tp_size, expert_parallel)
    layers = []
    for index in range(*share.layers):
        prefix = f"model.layers.{index}."
        attn_prefix = prefix + "self_attn."
        qkv_weight = weights.linear([
            (attn_prefix + "q_proj.weight", 0, *q_rows),
            (attn_prefix + "k_proj.weight", 0, *kv_rows),
            (attn_prefix + "v_proj.weight", 0, *kv_rows)])
        biases = [optional(attn_prefix + f"{p}_proj.bias", 0, *rows)
                  for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
        qkv_bias = None
        if any(b is not None for b in biases):
            if any(b is None for b in biases):
                raise ValueError(f"{attn_prefix}: q/k/v biases must be all present or all absent")
            qkv_bias = torch.cat([b for b in biases if b is not None])
        window = features.window_of(index)
        rope_index = len(rotaries) - 1 if window else 0
        attention = Attention(
            qkv_proj=ColumnParallelLinear(qkv_weight, qkv_bias),
            o_proj=RowParallelLinear(weights.linear([(attn_prefix + "o_proj.weight", 1,
                                                       *q_rows)]), tp_group,
                                     bias=optional(attn_prefix + "o_proj.bias")),
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=head_dim,
            rotary=rotaries[rope_index],
            q_norm=norm(attn_prefix + "q_norm.weight") if features.qk_norm else None,
            k_norm=norm(attn_prefix + "k_norm.weight") if features.qk_norm else None,
            scale=features.attention_scale, softcap=features.attn_logit_softcapping,
            dcp=dcp_group, dcp_head_counts=dcp_head_counts)
        if moe is not None and experts is not None and moe.is_sparse(index):
            layers.append(DecoderLayer(
                input_norm=norm(prefix + "input_layernorm.weight"), attention=attention,
                post_norm=norm(prefix + "post_attention_layernorm.weight"),
                activation=features.activation, window=window, rope_index=rope_index,
                moe=load_moe_block(read, moe, index, experts, tp_group, ep_group=ep_group,
                                   dp_group=dp_group, linear=weights.linear)))
            continue
        mlp_prefix = prefix + "mlp."
        gate_up = weights.linear([(mlp_prefix + "gate_proj.weight", 0, *mlp_rows),
                                  (mlp_prefix + "up_proj.weight", 0, *mlp_rows)])
        sandwich = features.sandwich_norms
        layers.append(DecoderLayer(
            input_norm=norm(prefix + "input_layernorm.weight"),
            attention=attention,
            post_norm=norm(prefix + ("pre_feedforward_layernorm.weight" if sandwich
                                     else "post_attention_layernorm.weight")),
            gate_up=ColumnParallelLinear(gate_up),
            down=RowParallelLinear(weights.linear([(mlp_prefix + "down_proj.weight", 1,
                                                    *mlp_rows)]), tp_group),
            attn_out_norm=norm(prefix + "post_attention_layernorm.weight") if sandwich
            else None,
            mlp_out_norm=norm(prefix + "post_feedforward_layernorm.weight") if sandwich
            else None,
            activation=features.activation, window=window, rope_index=rope_index))
    vocab_start, vocab_stop = share.vocab
    embedding = lm_head = final_norm = None
    untied = not config.tie_word_embeddings and "lm_head.weight" in names
    # tied: one read of the rows serves both ends
    embed_rows, head, head_rows = weights.vocab(
        "model.embed_tokens.weight", vocab_start, vocab_stop, embedding=is_first,
        head=is_last and not untied)
    if embed_rows is not None:
        embedding = VocabParallelEmbedding(embed_rows, vocab_start, tp_group, dtype=dtype)
    if is_last:
        final_norm = norm("model.norm.weight")
        if untied:
            _, head, head_rows = weights.vocab("lm_head.weight", vocab_start, vocab_stop,
                                               embedding=False, head=True)
        assert head is not None
        lm_head = ParallelLMHead(head, tp_group, head_rows)
    return LlamaStage(share=share, layers=layers, embedding=embedding, final_norm=final_norm,
                      lm_head=lm_head, rotary=rotary, num_kv_heads=attn.num_kv_heads,
                      head_dim=head_dim, dtype=dtype, device=device, rotaries=rotaries,
                      embedding_scale=config.hidden_size ** 0.5 if features.embedding_scale
                      else None,
                      final_logit_softcapping=features.final_logit_softcapping,
                      packed=weights.describe())
