"""Prompt-lookup drafts: guess the next tokens by finding the latest n-gram
in what the request has seen so far.

For ``n`` from ``max_n`` down to ``min_n``, look for the most recent earlier
occurrence of the request's last ``n`` tokens; the (up to) ``num_draft``
tokens that followed it are the proposal.  No match: no proposal.  Cheap,
model-free, and often right for summarisation, code edits and chat that
quotes its context.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], *, num_draft: int = 3, max_n: int = 3,
            min_n: int = 1) -> list[int]:
    """Draft tokens for the sequence ``tokens`` (empty when nothing matches)."""
    if num_draft < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"bad n-gram settings: num_draft={num_draft}, n in [{min_n}, {max_n}]")
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n:])
        # Latest start first; the match must end before the suffix itself starts.
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + num_draft])
                if follow:
                    return follow
    return []
