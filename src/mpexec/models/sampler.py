"""From float32 logits to one token per request.

Order of operations, per row::

    logits ── grammar bitmask (disallowed -> -inf) ── logprobs (log_softmax, on request)
           ── greedy: argmax
           ── else:   / temperature ── top-k ── top-p ── min-p ── softmax = p
                      token = argmax(p / q),  q ~ Exp(1) drawn from seed(request seed, position)

The exponential race (``argmax p_i / q_i`` with i.i.d. exponential ``q``) is
an exact draw from ``p``.  Its noise comes from a generator seeded by the
request's seed and the position of the token being sampled only, so a
request gets the same tokens whatever else shares the batch, on whichever
rank samples it.  Stop tokens and ``max_tokens`` are the engine's business;
the sampler only picks tokens (never :data:`~mpexec.outputs.PLACEHOLDER_TOKEN_ID`:
a row with no allowed token is an error).

The logprob returned is that of the sampled token under the model's
distribution after the grammar mask and before temperature and filters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpexec.outputs import SamplingParams

_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from ``(seed, position)`` (splitmix64 mixing, so
    neighbouring seeds or positions give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def unpack_bitmask(bitmask: Any, vocab_size: int, device: torch.device) -> torch.Tensor:
    """int32 bitmask rows (bit ``i % 32`` of word ``i // 32`` set = token ``i``
    allowed) as a bool tensor ``[rows, vocab_size]``."""
    words = torch.as_tensor(bitmask, dtype=torch.int32, device=device)
    if words.dim() == 1:
        words = words.unsqueeze(0)
    if words.shape[1] * 32 < vocab_size:
        raise ValueError(
            f"grammar bitmask has {words.shape[1]} words per row; vocab_size {vocab_size} "
            f"needs {(vocab_size + 31) // 32}")
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool()
    return allowed.reshape(words.shape[0], -1)[:, :vocab_size]


@dataclass(frozen=True)
class SampleRequest:
    """One row to sample: its parameters, seed and the position of the token."""

    params: SamplingParams
    seed: int
    position: int


def _filter_row(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of one row after top-k, top-p and min-p."""
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        threshold = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        drop_sorted = before >= params.top_p  # the first token always stays
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def sample(logits: torch.Tensor, requests: Sequence[SampleRequest],
           allowed: torch.Tensor | None = None) -> tuple[list[int], list[float] | None]:
    """Tokens for each row of ``logits`` ``[n, vocab]`` (float32), and their
    logprobs when any request asked for them (else None).

    ``allowed`` is a bool mask ``[n, vocab]`` (True = allowed) or None.
    """
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
    if allowed is not None:
        if not bool(allowed.any(dim=-1).all()):
            raise ValueError("the grammar bitmask allows no token for a request")
        logits = logits.masked_fill(~allowed, float("-inf"))
    tokens = [0] * len(requests)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        picked = to_host_list(logits[rows].argmax(dim=-1))
        for i, token in zip(greedy, picked, strict=True):
            tokens[i] = token
    vocab = logits.shape[-1]
    generator = torch.Generator(device=logits.device)
    random_rows: list[int] = []
    random_picks: list[torch.Tensor] = []
    for i, request in enumerate(requests):
        if request.params.greedy:
            continue
        probs = _filter_row(logits[i] / request.params.temperature, request.params)
        generator.manual_seed(noise_seed(request.seed, request.position))
        noise = torch.empty(vocab, device=logits.device).exponential_(generator=generator)
        random_rows.append(i)
        random_picks.append((probs / noise).argmax())
    if random_picks:  # one copy to the host for all of them
        for i, token in zip(random_rows, to_host_list(torch.stack(random_picks)), strict=True):
            tokens[i] = token
    logprobs = None
    if any(r.params.logprobs for r in requests):
        index = torch.tensor(tokens, device=logits.device).unsqueeze(-1)
        logprobs = to_host_list(
            torch.log_softmax(logits, dim=-1).gather(-1, index).squeeze(-1))
    return tokens, logprobs


def to_host_list(values: torch.Tensor) -> list[Any]:
    """``values.tolist()``; from a CUDA device through pinned host memory.

    A copy from the GPU into pageable memory is staged by the driver through
    a pinned buffer of its own; copying into a pinned tensor (torch caches
    those allocations) is one DMA transfer, after which only this stream is
    waited on, not the whole device.
    """
    if values.device.type != "cuda":
        return values.tolist()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    torch.cuda.current_stream(values.device).synchronize()
    return host.tolist()
