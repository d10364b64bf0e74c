"""Test-only helpers of the model tests: a random transformers Llama saved as
an HF checkpoint (read back with the real loader, ``open_checkpoint``), and a
threaded tensor-parallel group so that several ranks of one model can run in
one process."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch


def save_random_llama(directory: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight transformers Llama (or Qwen2 with ``qwen2=True``) saved
    as safetensors; returns the directory."""
    import transformers

    qwen2 = overrides.pop("qwen2", False)
    shape = dict(vocab_size=101, hidden_size=72, intermediate_size=77, num_hidden_layers=3,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
    shape.update(overrides)
    torch.manual_seed(seed)
    if qwen2:
        config = transformers.Qwen2Config(**shape)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**shape)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random biases too, so that a lost bias shows
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(directory)
    return directory


class ThreadedGroup:
    """One rank's view of a TP group whose ranks are threads of this process.

    Collectives meet at a barrier; results are the same tensor values on
    every rank, as the real group guarantees."""

    def __init__(self, shared: dict[str, Any], rank: int, size: int) -> None:
        self._shared = shared
        self.rank_in_group = rank
        self.world_size = size

    @classmethod
    def make(cls, size: int) -> list[ThreadedGroup]:
        shared: dict[str, Any] = {"barrier": threading.Barrier(size), "slots": [None] * size}
        return [cls(shared, rank, size) for rank in range(size)]

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self._shared["slots"], self._shared["barrier"]
        slots[self.rank_in_group] = tensor
        barrier.wait(timeout=30)
        parts = list(slots)
        barrier.wait(timeout=30)
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)


def run_ranks(size: int, fn: Any) -> list[Any]:
    """``fn(rank, group)`` on ``size`` threads; their results in rank order."""
    groups = ThreadedGroup.make(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, groups[rank])
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            groups[rank]._shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


FAMILIES = {
    # family: (config class, model class, shape overrides)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6,
                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "eos_token_id": 2}),
}


def save_random_family(directory: Path, family: str, *, seed: int = 0,
                       **overrides: Any) -> Path:
    """A random-weight transformers model of ``family`` (``FAMILIES``) saved as
    safetensors.  Weights are drawn wider than transformers' init (std 0.1) and
    every norm weight is jittered, so a misplaced norm, offset or scale shows."""
    import transformers

    config_name, model_name, family_shape = FAMILIES[family]
    shape: dict[str, Any] = dict(
        vocab_size=101, hidden_size=72, intermediate_size=77, num_hidden_layers=7,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=family.startswith("gemma"),
        initializer_range=0.1, bos_token_id=1)
    shape.update(family_shape)
    shape.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**shape)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory
