"""From float32 logits to one token per request.

Order of operations, per row::

    logits ── grammar bitmask (disallowed -> -inf)
           ── logprobs (log_softmax; top-k, the sampled token's and its rank; on request)
           ── min_tokens: EOS / stop token ids -> -inf while the output is short
           ── logit_bias (+ bias)
           ── penalties: repetition (prompt + output), frequency and presence (output)
           ── greedy: argmax
           ── else:   / temperature ── top-k ── top-p ── min-p ── softmax = p
                      token = argmax(p / q),  q ~ Exp(1) drawn from seed(request seed, position)

Everything but drawing the noise (one generator per row) is a tensor
operation over the rows that need it: penalties read per-request count
vectors (:class:`TokenHistory`, kept up to date incrementally on the
sampling ranks), ``logit_bias`` and the ``min_tokens`` mask are one scatter
over all rows, and the filters share one partial sort (:func:`filter_rows`).  The exponential race
(``argmax p_i / q_i`` with i.i.d. exponential ``q``) is an exact draw from
``p``.  Its noise comes from a generator seeded by the request's seed and
the position of the token being sampled only, so a request gets the same
tokens whatever else shares the batch, on whichever rank samples it.  Stop
tokens and ``max_tokens`` are the engine's business; the sampler only picks
tokens (never :data:`~mpexec.outputs.PLACEHOLDER_TOKEN_ID`: a row with no
allowed token is an error).

The logprobs returned are those of the model's distribution after the
grammar mask and before penalties, bias, temperature and filters (vLLM's
"raw" logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpexec.outputs import LogprobsRow, SamplingParams

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


class TokenHistory:
    """A request's tokens as count vectors over the vocabulary, for penalties.

    ``token_ids`` is the request's token list (shared with the worker's
    request table, which appends to it); ``num_prompt_tokens`` of them are
    the prompt.  :meth:`vectors` counts only what was appended since the last
    call, so a decode step adds one token, not the whole history.
    """

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.output_counts: torch.Tensor | None = None  # int32 [vocab]
        self.in_prompt: torch.Tensor | None = None  # bool [vocab]
        self._counted = 0

    def vectors(self, upto: int, vocab: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(output token counts, prompt token presence) of ``token_ids[:upto]``."""
        if self.output_counts is None or self.in_prompt is None:
            self.output_counts = torch.zeros(vocab, dtype=torch.int32, device=device)
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        upto = min(upto, len(self.token_ids))
        if upto > self._counted:
            split = min(max(self._counted, self.num_prompt_tokens), upto)
            prompt = [t for t in self.token_ids[self._counted:split] if 0 <= t < vocab]
            output = [t for t in self.token_ids[split:upto] if 0 <= t < vocab]
            if prompt:
                self.in_prompt[torch.tensor(prompt, device=device)] = True
            if output:
                index = torch.tensor(output, device=device)
                self.output_counts.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))
            self._counted = upto
        return self.output_counts, self.in_prompt


@dataclass(frozen=True)
class SampleRequest:
    """One row to sample: its parameters, seed and the position of the token.

    ``num_output_tokens`` is how many output tokens come before this one
    (for ``min_tokens``), ``min_tokens_stop_ids`` the ids banned until
    ``min_tokens`` is reached, ``history`` the counts penalties need (None
    when the request has no penalty).
    """

    params: SamplingParams
    seed: int
    position: int
    num_output_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    history: TokenHistory | None = None


def argmax_suffices(requests: Sequence[SampleRequest]) -> bool:
    """True when every row's token is the argmax of its logits as they come:
    greedy, and nothing above reads or changes the other logits (no logprobs,
    grammar, logit_bias, penalties, nor a min_tokens ban in force)."""
    return all(r.params.greedy and r.params.logprobs is None
               and r.params.guided_decoding is None and not r.params.logit_bias
               and not r.params.has_penalties
               and not (r.num_output_tokens < r.params.min_tokens and r.min_tokens_stop_ids)
               for r in requests)


CANDIDATES = 1024
"""How many of a row's most likely tokens top-k and top-p look at first: a
partial sort (``topk``) of these is far cheaper than sorting the vocabulary,
and it decides exactly whenever the nucleus ends inside them (else the row
is sorted in full)."""


def filter_rows(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities of rows ``[m, vocab]`` (logits / temperature) after each row's
    top-k, top-p and min-p.

    The rows' ``CANDIDATES`` largest logits come from one ``topk``; top-k
    (k within them) and top-p (when the mass above the last candidate
    already reaches p, every token outside them is dropped too) are decided
    on those, and the rows where that is not enough are sorted in full.
    """
    vocab = scaled.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p == 1 for p in top_p):
        probs = torch.softmax(scaled, dim=-1)
    else:
        probs = _top_k_top_p(scaled, top_k, top_p)
    if any(p.min_p > 0 for p in params):
        floor = torch.tensor([p.min_p for p in params], dtype=probs.dtype,
                             device=probs.device).unsqueeze(-1)
        probs = probs.masked_fill(probs < floor * probs.amax(-1, keepdim=True), 0.0)
    return probs


def _top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    count = min(vocab, max(CANDIDATES, *top_k))
    values, order = scaled.topk(count, dim=-1)  # sorted, descending
    if any(top_k):
        # the k-th largest per row; a row without top-k takes -inf (keeps all)
        kth = torch.tensor([k - 1 if k else 0 for k in top_k], device=scaled.device)
        threshold = values.gather(-1, kth.unsqueeze(-1))
        no_k = torch.tensor([not k for k in top_k], device=scaled.device).unsqueeze(-1)
        threshold = threshold.masked_fill(no_k, float("-inf"))
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
        values = values.masked_fill(values < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if all(p == 1 for p in top_p):
        return probs
    # a row without top-p gets a bound no mass reaches
    bound = torch.tensor([p if p < 1 else 2.0 for p in top_p], dtype=probs.dtype,
                         device=probs.device).unsqueeze(-1)
    sorted_probs = probs.gather(-1, order)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
    drop_sorted = before >= bound  # the first token always stays
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, ~drop_sorted)
    if count < vocab:
        # Tokens outside the candidates are dropped only if the last candidate
        # is; rows where it is not (a wide nucleus) are decided by a full sort.
        undecided = (~drop_sorted[:, -1]).nonzero().flatten().tolist()
        for row in undecided:
            if top_p[row] < 1:
                keep[row] = _full_top_p(probs[row], top_p[row])
            else:
                keep[row] = probs[row] > 0
    return probs.masked_fill(~keep, 0.0)


def _full_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens of one row that top-p keeps (True), by a full sort."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    return torch.empty_like(probs, dtype=torch.bool).scatter_(-1, order, before < top_p)


def sample(logits: torch.Tensor, requests: Sequence[SampleRequest],
           allowed: torch.Tensor | None = None,
           ) -> tuple[list[int], list[LogprobsRow | None] | None]:
    """Tokens for each row of ``logits`` ``[n, vocab]`` (float32), and their
    logprobs (a row per request that asked, else None; None when none asked).

    ``allowed`` is a bool mask ``[n, vocab]`` (True = allowed) or None.
    ``logits`` is not modified.
    """
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
    if allowed is not None:
        if not bool(allowed.any(dim=-1).all()):
            raise ValueError("the grammar bitmask allows no token for a request")
        logits = logits.masked_fill(~allowed, float("-inf"))
    wants_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    raw = logits
    logits = process_logits(logits, requests)
    tokens = [0] * len(requests)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        picked = to_host_list(logits[rows].argmax(dim=-1))
        for i, token in zip(greedy, picked, strict=True):
            tokens[i] = token
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        params = [requests[i].params for i in sampled]
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                                   device=logits.device).unsqueeze(-1)
        probs = filter_rows(logits[rows] / temperature, params)
        # One generator per row, seeded by (request seed, position): the noise
        # of a row never depends on the other rows.
        noise = torch.empty_like(probs)
        generator = torch.Generator(device=logits.device)
        for n, i in enumerate(sampled):
            generator.manual_seed(noise_seed(requests[i].seed, requests[i].position))
            noise[n].exponential_(generator=generator)
        picked = to_host_list((probs / noise).argmax(dim=-1))  # one copy for all rows
        for i, token in zip(sampled, picked, strict=True):
            tokens[i] = token
    if not wants_logprobs:
        return tokens, None
    rows_out: list[LogprobsRow | None] = [None] * len(requests)
    computed = logprob_rows(raw[torch.tensor(wants_logprobs, device=raw.device)],
                            [tokens[i] for i in wants_logprobs],
                            [requests[i].params.logprobs or 0 for i in wants_logprobs])
    for i, row in zip(wants_logprobs, computed, strict=True):
        rows_out[i] = row
    return tokens, rows_out


def process_logits(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """``logits`` after min_tokens, logit_bias and the penalties (a new tensor
    when any applies; ``logits`` itself otherwise)."""
    device = logits.device
    vocab = logits.shape[-1]
    # One scatter for the min_tokens bans and the logit biases of every row.
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for i, r in enumerate(requests):
        if r.num_output_tokens < r.params.min_tokens and r.min_tokens_stop_ids:
            ids = [t for t in r.min_tokens_stop_ids if 0 <= t < vocab]
            ban_rows.extend([i] * len(ids))
            ban_cols.extend(ids)
        if r.params.logit_bias:
            # ids past the vocabulary are the front end's to refuse; here they are ignored
            items = [(t, b) for t, b in r.params.logit_bias.items() if t < vocab]
            bias_rows.extend([i] * len(items))
            bias_cols.extend(t for t, _ in items)
            bias_vals.extend(b for _, b in items)
    penalised = [i for i, r in enumerate(requests)
                 if r.history is not None and r.params.has_penalties]
    if not (ban_rows or bias_rows or penalised):
        return logits
    logits = logits.clone()
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=device),
                           torch.tensor(bias_cols, device=device)),
                          torch.tensor(bias_vals, dtype=logits.dtype, device=device),
                          accumulate=True)
    if penalised:
        every_row = len(penalised) == len(requests)
        rows = torch.tensor(penalised, device=device)
        vectors = [requests[i].history.vectors(requests[i].position, vocab, device)  # type: ignore[union-attr]
                   for i in penalised]
        counts = torch.stack([c for c, _ in vectors])
        in_prompt = torch.stack([p for _, p in vectors])
        params = [requests[i].params for i in penalised]
        penalties = apply_penalties(
            logits if every_row else logits[rows], counts, in_prompt,
            _column([p.repetition_penalty for p in params], logits, unless=1.0),
            _column([p.frequency_penalty for p in params], logits, unless=0.0),
            _column([p.presence_penalty for p in params], logits, unless=0.0))
        if not every_row:
            logits[rows] = penalties
    if ban_rows:
        logits[torch.tensor(ban_rows, device=device),
               torch.tensor(ban_cols, device=device)] = float("-inf")
    return logits


def _column(values: list[float], like: torch.Tensor, unless: float) -> torch.Tensor | None:
    """``values`` as a column ``[m, 1]``, or None when every value is ``unless`` (off)."""
    if all(v == unless for v in values):
        return None
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(-1)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None) -> torch.Tensor:
    """vLLM's penalties on rows ``[m, vocab]`` (modified in place and returned);
    each penalty is a column ``[m, 1]``, or None when no row has it.

    Repetition (prompt or output tokens): a positive logit is divided by the
    penalty, a negative one multiplied.  Then frequency (times the count in
    the output) and presence (once per token in the output) are subtracted.
    Only the tokens seen (at most the history's length per row) change, so
    they are gathered, penalised and scattered back: two comparisons and a
    ``nonzero`` are the only passes over the whole vocabulary.
    """
    in_output = output_counts > 0
    rows, cols = ((in_output | in_prompt) if repetition is not None
                  else in_output).nonzero(as_tuple=True)
    values = logits[rows, cols]
    if repetition is not None:
        penalty = repetition.squeeze(-1)[rows]
        values = torch.where(values > 0, values / penalty, values * penalty)
    if frequency is not None or presence is not None:
        counts = output_counts[rows, cols].to(logits.dtype)
        if frequency is not None:
            values = values - frequency.squeeze(-1)[rows] * counts
        if presence is not None:
            values = values - presence.squeeze(-1)[rows] * (counts > 0).to(logits.dtype)
    return logits.index_put_((rows, cols), values)


def logprob_rows(logits: torch.Tensor, token_ids: Sequence[int],
                 top_k: Sequence[int]) -> list[LogprobsRow]:
    """For each row of ``logits`` ``[m, vocab]``: the log-probability and rank
    of ``token_ids[i]`` and the ``top_k[i]`` most likely tokens."""
    logprobs = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(list(token_ids), device=logits.device).unsqueeze(-1)
    chosen = logprobs.gather(-1, index)
    ranks = to_host_list((logprobs > chosen).sum(-1) + 1)
    k = max(top_k, default=0)
    top_values: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k > 0:
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = to_host_list(values), to_host_list(ids)
    return [LogprobsRow(int(t), float(lp), int(rank), ids[:n], values[:n])
            for t, lp, rank, ids, values, n in zip(
                token_ids, to_host_list(chosen.squeeze(-1)), ranks, top_ids, top_values, top_k,
                strict=True)]


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
