"""Verifying draft tokens: which of them a step accepts.

A request that carries drafts ``d1 … dk`` runs its last token ``t0`` and the
drafts in one forward pass (positions ``p … p+k``).  Row ``j`` of the logits
(position ``p+j``) is the model's distribution for position ``p+j+1`` given
``t0 d1 … dj``, so the sampler draws a token ``s_j`` from every row, exactly
as it would without drafts (same processing, same noise: the noise of a
position depends on the request's seed and the position only)::

    inputs   t0   d1   d2   d3          drafts d1 d2 d3
    sampled  s0   s1   s2   s3          s0 == d1, s1 == d2, s2 != d3
    emitted  s0   s1   s2               (d1, d2 accepted; s2 replaces d3)

The step emits ``s_0 … s_m`` where ``m`` is the length of the longest prefix
with ``s_j == d_{j+1}``: the accepted drafts, then the first token the model
disagrees with (or, with every draft accepted, a bonus token from the last
row).  Row ``j`` is used only when ``d1 … dj`` were all accepted, so its
context is the one the request really has.

This is speculative rejection sampling with the draft as a point mass:
the draft ``x`` is accepted with probability ``P(s = x) = p(x)``, and on
rejection the emitted token is ``s`` given ``s != x``, i.e. ``p`` with ``x``
removed and renormalised.  The output distribution is the model's; more: a
request gets the very tokens it gets without drafts (greedy and seeded
sampling alike), up to the rounding of a wider forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a request emits: ``sampled`` (one per row, ``len(drafts) + 1``)
    up to and including the first one that differs from its draft."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(sampled)} sampled tokens for {len(drafts)} drafts "
                         "(one per draft and one more)")
    matched = 0
    while matched < len(drafts) and sampled[matched] == drafts[matched]:
        matched += 1
    return list(sampled[:matched + 1])
