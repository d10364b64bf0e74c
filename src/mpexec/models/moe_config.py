"""The mixture-of-experts part of a model's shape, read from config.json or GGUF.

Two checkpoint styles, both as transformers writes them (one tensor per expert)::

    mixtral     model.layers.L.block_sparse_moe.gate.weight            [E, H]  router
                model.layers.L.block_sparse_moe.experts.e.w1.weight    [I, H]  gate
                                                         .w3.weight    [I, H]  up
                                                         .w2.weight    [H, I]  down
    qwen_moe    model.layers.L.mlp.gate.weight                         [E, H]  (Qwen2/3-MoE)
                model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight
                model.layers.L.mlp.shared_expert.{gate,up,down}_proj.weight   (Qwen2-MoE)
                model.layers.L.mlp.shared_expert_gate.weight           [1, H]

Routing is softmax over the experts, the top ``top_k`` kept, renormalised to
sum to one when ``norm_topk_prob`` (always for Mixtral).  Qwen-style models
may keep a dense MLP (``intermediate_size``, the usual ``mlp.*_proj`` names)
on some layers: those in ``mlp_only_layers`` and those not on the
``decoder_sparse_step`` grid.

GGUF (llama.cpp's converter) stores the same models as ``llama`` (Mixtral),
``qwen2moe`` and ``qwen3moe`` with ``<arch>.expert_count``,
``expert_used_count``, ``expert_feed_forward_length`` (else
``feed_forward_length``) and ``expert_shared_feed_forward_length``; the file
does not say whether the top-k weights are renormalised (llama.cpp decides
by architecture: Mixtral and Qwen3-MoE yes, Qwen2-MoE no) unless it has
``<arch>.expert_weights_norm``, and every layer is sparse.  Pure
arithmetic, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpexec.models.errors import CheckpointError

# model_type ─► checkpoint style
MOE_MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen_moe", "qwen3_moe": "qwen_moe"}
# GGUF architecture ─► (checkpoint style, top-k weights renormalised)
GGUF_MOE_ARCHITECTURES = {"llama": ("mixtral", True), "qwen2moe": ("qwen_moe", False),
                          "qwen3moe": ("qwen_moe", True)}


@dataclass(frozen=True)
class MoEConfig:
    style: str  # "mixtral" or "qwen_moe": the tensor names (module docstring)
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` holds experts (else a dense MLP)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def prefix(self, layer: int) -> str:
        block = "block_sparse_moe" if self.style == "mixtral" else "mlp"
        return f"model.layers.{layer}.{block}."

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """The (gate, up, down) weight names of one expert."""
        base = f"{self.prefix(layer)}experts.{expert}."
        if self.style == "mixtral":
            return base + "w1.weight", base + "w3.weight", base + "w2.weight"
        return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"

    def shapes(self, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """The tensors of one sparse layer's MoE block, with their shapes."""
        i = self.moe_intermediate_size
        p = self.prefix(layer)
        shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (self.num_experts, hidden)}
        for expert in range(self.num_experts):
            gate, up, down = self.expert_names(layer, expert)
            shapes[gate] = shapes[up] = (i, hidden)
            shapes[down] = (hidden, i)
        s = self.shared_expert_intermediate_size
        if s:
            shapes[p + "shared_expert.gate_proj.weight"] = (s, hidden)
            shapes[p + "shared_expert.up_proj.weight"] = (s, hidden)
            shapes[p + "shared_expert.down_proj.weight"] = (hidden, s)
            shapes[p + "shared_expert_gate.weight"] = (1, hidden)
        return shapes


def moe_from_hf(raw: Mapping[str, Any], model_type: str, source: str | Path,
                num_layers: int) -> MoEConfig:
    """The MoEConfig of a config.json whose ``model_type`` is in ``MOE_MODEL_TYPES``."""
    style = MOE_MODEL_TYPES[model_type]
    dense_layers: tuple[int, ...] = ()

    def integer(key: str, default: int | None = None) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(source, key, f"expected an integer, got {value!r}")
        return value

    if style == "mixtral":
        num_experts = integer("num_local_experts")
        intermediate = integer("intermediate_size")
        shared = 0
        norm = True
        step = 1
    else:
        # transformers 5 writes Qwen3-MoE's count as num_local_experts
        num_experts = integer("num_experts" if raw.get("num_experts") is not None
                              else "num_local_experts")
        intermediate = integer("moe_intermediate_size")
        shared = integer("shared_expert_intermediate_size", 0)
        norm = bool(raw.get("norm_topk_prob", False))
        step = integer("decoder_sparse_step", 1)
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(x, int) for x in only):
            raise CheckpointError(source, "mlp_only_layers", f"expected a list of layer "
                                  f"indices, got {only!r}")
        dense_layers = tuple(sorted(set(only)))
    top_k = integer("num_experts_per_tok")
    if num_experts < 1:
        raise CheckpointError(source, "num_experts", f"must be positive, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise CheckpointError(source, "num_experts_per_tok", f"{top_k} must be in "
                              f"[1, {num_experts}] (the number of experts)")
    if intermediate < 1 or shared < 0 or step < 1:
        raise CheckpointError(source, "moe_intermediate_size", "expert sizes must be "
                              "positive (and decoder_sparse_step >= 1)")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(source, "hidden_act", f"{raw.get('hidden_act')!r} is not "
                              "supported (silu only)")
    if any(not 0 <= x < num_layers for x in dense_layers):
        raise CheckpointError(source, "mlp_only_layers", f"{list(dense_layers)} names a layer "
                              f"outside [0, {num_layers})")
    return MoEConfig(style=style, num_experts=num_experts, top_k=top_k,
                     moe_intermediate_size=intermediate, norm_topk_prob=norm,
                     shared_expert_intermediate_size=shared, decoder_sparse_step=step,
                     mlp_only_layers=dense_layers)


def moe_from_gguf(fields: Mapping[str, Any], arch: str, source: str | Path) -> MoEConfig:
    """The MoEConfig of a GGUF file whose ``<arch>.expert_count`` is set."""
    if arch not in GGUF_MOE_ARCHITECTURES:
        raise CheckpointError(source, f"{arch}.expert_count", "mixture-of-experts models of "
                              f"architecture {arch!r} are not supported (supported: "
                              f"{', '.join(GGUF_MOE_ARCHITECTURES)})")
    style, norm = GGUF_MOE_ARCHITECTURES[arch]

    def integer(key: str, default: int | None = None) -> int:
        value = fields.get(f"{arch}.{key}", default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(source, f"{arch}.{key}", f"expected an integer, got {value!r}")
        return value

    num_experts = integer("expert_count")
    top_k = integer("expert_used_count")
    intermediate = integer("expert_feed_forward_length", fields.get(
        f"{arch}.feed_forward_length"))
    shared = integer("expert_shared_feed_forward_length", 0)
    norm = bool(fields.get(f"{arch}.expert_weights_norm", norm))
    if not 1 <= top_k <= num_experts:
        raise CheckpointError(source, f"{arch}.expert_used_count", f"{top_k} must be in "
                              f"[1, {num_experts}] (the number of experts)")
    if intermediate < 1 or shared < 0:
        raise CheckpointError(source, f"{arch}.expert_feed_forward_length",
                              "expert sizes must be positive")
    return MoEConfig(style=style, num_experts=num_experts, top_k=top_k,
                     moe_intermediate_size=intermediate, norm_topk_prob=norm,
                     shared_expert_intermediate_size=shared)
