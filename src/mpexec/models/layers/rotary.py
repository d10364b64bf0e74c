"""Rotary position embeddings, with the scalings ``config.json`` may ask for.

The inverse frequencies follow the published recipes: plain (``rope_theta``),
``linear`` (positions divided by ``factor``), ``dynamic`` (NTK-aware: the base
grows once a sequence passes ``max_position_embeddings``), ``llama3``
(wavelength bands) and ``yarn`` (a ramp between interpolated and extrapolated
frequencies, cos/sin scaled by an attention factor).  cos/sin are tabulated
once for every position up to ``max_positions``, in float32, and applied in
the "rotate half" layout of Hugging Face checkpoints (the GGUF loader undoes
llama.cpp's interleaved permutation, so both formats land here).

``dynamic`` is per position: a token at position ``p`` is rotated with the
base of a sequence of length ``max(p + 1, max_position_embeddings)``.  That
is what a cached decode does (every key is rotated once, when written), and
it keeps a request's rotation independent of the other requests in a batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    return str(kind)


def _plain_inv_freq(base: float | torch.Tensor, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if isinstance(base, torch.Tensor):
        return 1.0 / (base.unsqueeze(-1) ** exponents)
    return 1.0 / (base ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, scaling: dict[str, Any],
                   max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = scaling.get("original_max_position_embeddings", max_position_embeddings)
    factor = scaling.get("factor") or max_position_embeddings / original

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(
                factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_tables(*, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                max_position_embeddings: int, max_positions: int,
                freq_factors: tuple[float, ...] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos`` and ``sin`` tables, ``[max_positions, head_dim]``.

    ``freq_factors`` (GGUF's ``rope_freqs`` tensor, how llama.cpp stores Llama
    3.1's scaling): each plain inverse frequency is divided by its factor."""
    kind = rope_type_of(rope_scaling)
    scaling = rope_scaling or {}
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    attention_factor = 1.0
    if kind == "dynamic":
        factor = scaling["factor"]
        seq_len = torch.clamp(positions + 1, min=max_position_embeddings)
        base = rope_theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2))
        freqs = positions.unsqueeze(-1) * _plain_inv_freq(base, head_dim)
    else:
        if kind == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(
                rope_theta, head_dim, scaling, max_position_embeddings)
        else:
            inv_freq = _plain_inv_freq(rope_theta, head_dim)
            if freq_factors is not None:
                inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
            if kind == "linear":
                inv_freq = inv_freq / scaling["factor"]
            elif kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


class RotaryEmbedding:
    """Rotates query and key heads by their positions (tables built once)."""

    def __init__(self, *, head_dim: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None, max_position_embeddings: int,
                 max_positions: int, dtype: torch.dtype, device: torch.device,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        cos, sin = rope_tables(head_dim=head_dim, rope_theta=rope_theta,
                               rope_scaling=rope_scaling,
                               max_position_embeddings=max_position_embeddings,
                               max_positions=max_positions, freq_factors=freq_factors)
        self.max_positions = max_positions
        self.half = head_dim // 2
        # cos/sin in the compute dtype, as the reference casts them before use.
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` ``[T]``, shaped ``[T, 1, head_dim]`` to
        broadcast over heads; computed once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, head_dim]`` rotated by its tokens' positions:
        ``x * cos + rotate_half(x) * sin`` in three kernels instead of five."""
        half = self.half
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        return out
