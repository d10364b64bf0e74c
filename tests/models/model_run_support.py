"""Test-only helpers of the model tests: a random transformers Llama saved as
an HF checkpoint, a minimal checkpoint reader over it (until the real loader
is on this branch), and a threaded tensor-parallel group so that several
ranks of one model can run in one process."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class StandInConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool


class StandInCheckpoint:
    """Reads a ``save_pretrained`` safetensors directory, slice by slice."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        raw = json.loads((path / "config.json").read_text())
        rope = raw.get("rope_scaling") or raw.get("rope_parameters")
        theta = raw.get("rope_theta") or (rope or {}).get("rope_theta", 10000.0)
        if rope is not None and rope.get("rope_type", rope.get("type")) == "default":
            rope = None
        self.config = StandInConfig(
            architecture=raw["architectures"][0], vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=raw["rms_norm_eps"], rope_theta=theta, rope_scaling=rope,
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False))
        self._files = [safe_open(str(f), "pt") for f in sorted(path.glob("*.safetensors"))]
        self._where = {name: f for f in self._files for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)

    def __enter__(self) -> StandInCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._files = []

    def names(self) -> list[str]:
        return list(self._where)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        piece = self._where[name].get_slice(name)
        if dim is None:
            return piece[:].to(dtype)
        index = [slice(None)] * len(piece.get_shape())
        index[dim] = slice(start, stop)
        return piece[tuple(index)].to(dtype)


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
