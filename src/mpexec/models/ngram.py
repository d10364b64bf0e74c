"""Prompt-lookup drafts: guess the next tokens by finding the latest n-gram
in what the request has seen so far.

For ``n`` from ``max_n`` down to ``min_n``, look for the most recent earlier
occurrence of the request's last ``n`` tokens; the ``num_draft`` tokens
that followed it are the proposal (when fewer follow before the end, the
pattern between the match and the end is taken to repeat: ``a b a b`` ->
``a b a …``).  No match: no proposal.  Cheap,
model-free, and often right for summarisation, code edits and chat that
quotes its context.

With ``by_match``, a match of ``n`` tokens vouches for at most ``n - 1``
drafts: a short match is often a coincidence (a common pair of tokens), and
a draft the model rejects is not free.  On a CPU, verifying ``r`` rows of
packed weights costs close to ``r`` times the row-dependent part of a step
(the int4 kernel dequantises its weights once per tile of 4 input rows, and
each token is two rows, bfloat16 high and low), so a long proposal after a
weak match costs more than its expected gain: measured on the rewrite task
of ``benchmarks/bench_spec.py``, acceptance went from 0.46 to 0.75 and the
steps with drafts got cheaper.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from mpexec.config import config_object


def propose(tokens: Sequence[int], *, num_draft: int = 3, max_n: int = 3,
            min_n: int = 1, by_match: bool = False) -> list[int]:
    """Draft tokens for the sequence ``tokens`` (empty when nothing matches);
    with ``by_match``, at most ``n - 1`` after a match of ``n`` tokens."""
    if num_draft < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"bad n-gram settings: num_draft={num_draft}, n in [{min_n}, {max_n}]")
    tokens = tokens if isinstance(tokens, list) else list(tokens)
    length = len(tokens)
    if length < 2:
        return []
    last = tokens[-1]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Latest match first; it must end before the suffix does (so that a
        # token follows it).  Comparing the last token first keeps the scan cheap.
        for end in range(length - 2, n - 2, -1):
            if tokens[end] == last and tokens[end - n + 1:end + 1] == suffix:
                # What followed the match, continued periodically when it runs
                # into the end (a repeating pattern goes on repeating).
                period = length - 1 - end
                count = min(num_draft, n - 1) if by_match else num_draft
                return [tokens[end + 1 + i % period] for i in range(count)]
    return []


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with prompt-lookup drafts (vLLM's field names).

    Each step, a request that decodes may carry up to ``num_speculative_tokens``
    drafts, found by :func:`propose` with n-grams of ``prompt_lookup_max``
    down to ``prompt_lookup_min`` tokens; the step verifies them
    (:mod:`mpexec.models.spec_decode`).  ``draft_by_match`` (mpexec's own
    field, not vLLM's) proposes at most ``n - 1`` drafts after a match of
    ``n`` tokens (:func:`propose`'s ``by_match``); ``False`` always proposes
    ``num_speculative_tokens``, as vLLM does.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    draft_by_match: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}; "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1; "
                                 f"got {value!r}")
        if not isinstance(self.draft_by_match, bool):
            raise ValueError(f"speculative_config.draft_by_match must be true or false; "
                             f"got {self.draft_by_match!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"exceeds prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict or its JSON; unknown keys are refused by name.  Given
        only one of the n-gram bounds, the other takes its value when the
        default would contradict it."""
        raw = config_object(raw, "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; "
                             f"known: {sorted(known)}")
        values = dict(raw)
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if high is not None and low is None and isinstance(high, int):
            values["prompt_lookup_min"] = min(cls.prompt_lookup_min, high)
        if low is not None and high is None and isinstance(low, int):
            values["prompt_lookup_max"] = max(cls.prompt_lookup_max, low)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def propose(self, tokens: Sequence[int]) -> list[int]:
        return propose(tokens, num_draft=self.num_speculative_tokens,
                       max_n=self.prompt_lookup_max, min_n=self.prompt_lookup_min,
                       by_match=self.draft_by_match)
