"""The MoE block's experts on rows sorted by expert equal the plain loop.

``MoEBlock.local_experts`` gathers every (token, expert) pair once, runs
each expert hit on its slice and scatters once; the reference below is the
textbook loop (transformers' eager Mixtral experts): per expert, gather its
tokens, run it, weight, ``index_add_``.  Both add a token's experts in
expert order, so the outputs are equal to the bit, for every rank's share
of the experts, with experts no token chose, and with no token at all.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from mpexec.models.layers.moe import MoEBlock  # noqa: E402

pytestmark = pytest.mark.torch
EXPERTS, HIDDEN, ROWS, TOP_K = 6, 32, 24, 2


class _Alone:
    world_size = 1
    rank_in_group = 0


def reference(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              gate_up: torch.Tensor, down: torch.Tensor, start: int) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for local in range(gate_up.shape[0]):
        token, slot = torch.where(ids == start + local)
        if not len(token):
            continue
        gate, up = F.linear(hidden[token], gate_up[local]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[local]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("share", [(0, 6), (0, 4), (4, 6)])  # all, EP rank 0, EP rank 1
def test_sorted_experts_equal_the_per_expert_loop(tokens: int, share: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(tokens * 10 + share[0])
    start, stop = share
    gate_up = torch.randn(stop - start, 2 * ROWS, HIDDEN, generator=generator)
    down = torch.randn(stop - start, HIDDEN, ROWS, generator=generator)
    router = torch.randn(EXPERTS, HIDDEN, generator=generator)
    router[EXPERTS - 1] -= 100  # an expert no token chooses
    block = MoEBlock(router=router, gate_up=gate_up, down=down, expert_start=start,
                     top_k=TOP_K, renormalize=True, group=_Alone())  # type: ignore[arg-type]
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    weights, ids = block.route(hidden)
    got = block.local_experts(hidden, weights, ids)
    assert torch.equal(got, reference(hidden, weights, ids, gate_up, down, start))
    assert torch.equal(block._run_experts(hidden, torch.zeros(tokens, dtype=torch.int64)),
                       _unweighted(hidden, gate_up[0], down[0]))


def _unweighted(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(hidden, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)
