"""A mixture-of-experts block, on this rank's share of the experts.

::

    router (replicated):  probs = softmax(hidden @ Wr.T)  (float32)
                          weights, ids = top_k(probs)  (renormalised when asked)
    experts held here:    the (token, expert) pairs sorted by expert once per layer:
                              x = hidden[token of each pair]          (one gather)
                              gu[e's pairs] = x[e's pairs] @ gate_up_e.T
                                  for each expert e hit (gate and up in one matrix)
                              a = silu(gu[:, :rows]) * gu[:, rows:]   (every pair at once)
                              y[e's pairs] = a[e's pairs] @ down_e.T  for each e hit
                              out[token] += y * weight                (one scatter, a
                                  token's experts added in expert order)
    shared expert:        out += sigmoid(hidden @ Wsg.T) * down_s(silu(gate_s(x)) * up_s(x))
    one all-reduce over the group sums the partial outputs

Two ways to share the experts among the ranks of the group, same code:

- tensor parallel: every rank holds every expert, each expert's gate/up
  rows and down columns split across the ranks (its partial down product is
  summed by the all-reduce, as in a dense row-parallel MLP);
- expert parallel: each rank holds whole experts ``[expert_start,
  expert_start + local)`` and computes only their contribution for the
  tokens routed to them; every rank holds every token (attention is the
  same on all of them), so the all-reduce that sums the contributions is
  also the combine.

The shared expert is always split the tensor-parallel way over the same
group, so its partial sum rides on the same all-reduce.

Across data parallel replicas (``dp_group`` given, ``group`` the EP group
of every replica's TP ranks) each replica has its own tokens (an idle one
takes part with its one dummy token); two ways to bring them to their
experts and back (``dispatch``):

- ``"all_to_all"`` (one TP rank per replica, so EP rank = DP rank): each
  rank routes its own tokens and sends every (token, chosen expert) pair,
  as the token's row plus the expert id, to the rank that holds the expert;
  that rank runs its experts on what it received and sends the outputs back
  in the order received; the sender weights them and sums them, rank by
  rank.  Two collectives, each carrying only the routed rows;
- ``"all_gather"`` (any TP size): the tokens are all-gathered over the DP
  group (every replica's rows, in DP order), every EP rank runs its experts
  on all of them, the EP all-reduce sums the contributions, and each
  replica keeps its own rows.  Three collectives, the last one over every
  replica's rows.

``benchmarks/bench_moe_dispatch.py`` measures the two: at two ranks on one
node they cost the same (the expert matmuls dominate); all_to_all is the
default wherever it applies because its traffic does not grow with the
number of replicas (docs/models.md).  The shared expert runs on the replica's own
tokens with its own TP all-reduce.

Each projection of the held experts (gate/up, down) is either one float
tensor ``[local experts, out, in]`` (``torch.mm`` per expert hit, into one
buffer) or one packed weight per expert (``layers.quantized``: the file's
groups of 32 kept as stored, ``quantization="auto"`` on a GGUF).  The packed
experts take the sorted rows the same way, through the packed kernels: the
rows are cut once into the kernels' bfloat16 ``[high; low]`` pairs, laid out
expert by expert (``quantized.ExpertRows``), so that each expert hit is one
kernel call on a contiguous block and its result one slice of the output.
Which rows split is each token's own (``quantized.SplitRows``, the step's
rule): it follows the pairs through the sort, and across replicas it travels
with the rows (a flag column beside the gathered rows, a bit above the
expert id beside the dispatched ones), so an expert computes a token the same
whatever else it is given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpexec.models.layers.parallel import ParallelGroup
from mpexec.models.layers.quantized import (
    ExpertRows,
    PackedWeight,
    SplitRows,
    Weight,
    matmul,
    step_rows,
)

_SPLIT_BIT = 40  # above any expert id: a dispatched pair's "this row splits" flag

# one projection of the held experts: stacked float [experts, out, in], or packed per expert
Experts = torch.Tensor | list[PackedWeight]


class SharedExpert:
    def __init__(self, gate_up: Weight, down: Weight, gate: torch.Tensor) -> None:
        self.gate_up = gate_up  # [2 * rows, H], this rank's rows of gate then up
        self.down = down        # [H, rows]
        self.gate = gate        # [1, H], whole

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = matmul(hidden, self.gate_up).chunk(2, dim=-1)
        out = matmul(F.silu(gate) * up, self.down)
        return torch.sigmoid(F.linear(hidden, self.gate)) * out


class MoEBlock:
    def __init__(self, *, router: torch.Tensor, gate_up: Experts, down: Experts,
                 expert_start: int, top_k: int, renormalize: bool, group: ParallelGroup,
                 shared: SharedExpert | None = None, dp_group: ParallelGroup | None = None,
                 tp_group: ParallelGroup | None = None,
                 expert_bounds: list[int] | None = None, dispatch: str = "all_to_all") -> None:
        self.router = router      # [E, H], every expert
        self.gate_up = gate_up    # [local experts, 2 * rows, H], or packed per expert
        self.down = down          # [local experts, H, rows], or packed per expert
        # a float projection's matrices as the matmul takes them (views, no copy)
        self.gate_up_t = _transposed(gate_up)
        self.down_t = _transposed(down)
        self.rows = _out_features(gate_up) // 2  # gate's rows, then up's
        self.expert_start = expert_start
        self.num_local = len(gate_up)
        self.top_k = top_k
        self.renormalize = renormalize
        self.group = group
        self.shared = shared
        self.dp_group = dp_group  # set: experts split across replicas (module docstring)
        self.tp_group = tp_group  # the shared expert's group in that case
        # EP rank r holds experts [expert_bounds[r], expert_bounds[r + 1])
        self.expert_bounds = expert_bounds
        if dispatch not in ("all_to_all", "all_gather"):
            raise ValueError(f"dispatch must be 'all_to_all' or 'all_gather'; got {dispatch!r}")
        self.dispatch = dispatch

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k ``(weights, expert ids)``, ``[T, k]`` each."""
        probs = torch.softmax(F.linear(hidden, self.router).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden.dtype), ids

    @property
    def packed(self) -> bool:
        return self.gate_up_t is None

    def _split_rule(self, hidden: torch.Tensor) -> SplitRows | None:
        """The step's rule for ``hidden``'s rows, where the experts are packed."""
        if not self.packed:
            return None
        return step_rows(hidden.shape[0]) or SplitRows.every(hidden.shape[0], hidden.device)

    def local_experts(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      split: SplitRows | None = None) -> torch.Tensor:
        """This rank's partial output: its experts on the tokens routed to them
        (``split``: which of ``hidden``'s rows split, packed experts only)."""
        out = torch.zeros_like(hidden)
        flat = ids.reshape(-1)  # (token, slot) pairs, token-major
        if self.num_local == self.router.shape[0]:  # every expert is here
            local, pairs = flat, None
        else:
            local = flat - self.expert_start
            pairs = torch.nonzero((local >= 0) & (local < self.num_local)).view(-1)
            if pairs.numel() == 0:
                return out
            local = local[pairs]
        order = torch.argsort(local, stable=True)  # by expert, token order within
        if pairs is not None:
            order = pairs[order]
        counts = torch.bincount(local, minlength=self.num_local).tolist()
        tokens = order // self.top_k
        y = self._expert_rows(hidden.index_select(0, tokens), counts,
                              None if split is None else split.take(tokens))
        y.mul_(weights.reshape(-1)[order, None])
        # one scatter; a token's contributions are added in expert order
        return out.index_add_(0, tokens, y)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None and self.dp_group.world_size > 1:
            if (self.dispatch == "all_to_all" and self.expert_bounds is not None
                    and (self.tp_group is None or self.tp_group.world_size == 1)):
                return self._all_to_all(hidden)
            return self._across_replicas(hidden, self.dp_group)
        weights, ids = self.route(hidden)
        out = self.local_experts(hidden, weights, ids, self._split_rule(hidden))
        if self.shared is not None:
            out = out + self.shared(hidden)
        if self.group.world_size > 1:
            out = self.group.all_reduce(out)
        return out

    def _across_replicas(self, hidden: torch.Tensor, dp_group: ParallelGroup) -> torch.Tensor:
        count = torch.tensor([[float(hidden.shape[0])]], device=hidden.device)
        counts = [int(c) for c in dp_group.all_gather(count, dim=0).view(-1).tolist()]
        rule = self._split_rule(hidden)
        split = None
        if rule is None:
            everyone = dp_group.all_gather(hidden, dim=0)
        else:  # each row's rule rides beside it, as a last column of 0 or 1
            flagged = torch.cat((hidden, rule.mask.to(hidden.dtype).unsqueeze(1)), dim=1)
            gathered = dp_group.all_gather(flagged, dim=0)
            everyone = gathered[:, :-1].contiguous()
            split = SplitRows(gathered[:, -1] != 0)
        weights, ids = self.route(everyone)
        out = self.group.all_reduce(self.local_experts(everyone, weights, ids, split))
        start = sum(counts[:dp_group.rank_in_group])
        mine = out[start:start + hidden.shape[0]]
        if self.shared is not None:
            shared = self.shared(hidden)
            if self.tp_group is not None and self.tp_group.world_size > 1:
                shared = self.tp_group.all_reduce(shared)
            mine = mine + shared
        return mine

    def _all_to_all(self, hidden: torch.Tensor) -> torch.Tensor:
        """Dispatch each (token, expert) pair to the expert's rank, combine back."""
        assert self.expert_bounds is not None
        group = self.group
        weights, ids = self.route(hidden)
        bounds = torch.tensor(self.expert_bounds[1:-1], device=ids.device)
        # (token, slot) pairs in the order of their owner rank, token order within
        flat_ids = ids.reshape(-1)
        owner = torch.bucketize(flat_ids, bounds, right=True)
        order = torch.argsort(owner, stable=True)
        splits = torch.bincount(owner, minlength=group.world_size).tolist()
        token_idx = order // self.top_k
        row_bytes = hidden.shape[1] * hidden.element_size()
        tagged = flat_ids[order]
        rule = self._split_rule(hidden)
        if rule is not None:  # a split row's pairs carry a bit above the expert id
            tagged = tagged | (rule.mask[token_idx].to(torch.int64) << _SPLIT_BIT)
        sent = torch.cat([hidden[token_idx].view(torch.uint8).reshape(-1, row_bytes),
                          tagged.view(torch.uint8).reshape(-1, 8)], dim=1)
        received, counts = group.all_to_all(sent, splits)
        x = received[:, :row_bytes].contiguous().view(hidden.dtype)
        tags = received[:, row_bytes:].contiguous().view(torch.int64).reshape(-1)
        expert = tags & ((1 << _SPLIT_BIT) - 1)
        split = SplitRows((tags >> _SPLIT_BIT) != 0) if rule is not None else None
        y = self._run_experts(x, expert - self.expert_start, split)
        back, _ = group.all_to_all(y, counts)
        # each rank's outputs summed apart, then rank by rank (the EP all-reduce's order)
        weighted = back * weights.reshape(-1)[order, None]
        partial = torch.zeros((group.world_size, *hidden.shape), dtype=hidden.dtype,
                              device=hidden.device)
        start = 0
        for rank, count in enumerate(splits):
            if count:
                partial[rank].index_add_(0, token_idx[start:start + count],
                                         weighted[start:start + count])
            start += count
        out = partial.sum(dim=0) if group.world_size > 2 else partial[0] + partial[1]
        if self.shared is not None:
            out = out + self.shared(hidden)
        return out

    def _run_experts(self, x: torch.Tensor, local: torch.Tensor,
                     split: SplitRows | None = None) -> torch.Tensor:
        """Unweighted outputs of local expert ``local[i]`` on row ``x[i]``, in row order."""
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.num_local).tolist()
        out = torch.empty_like(x)
        out[order] = self._expert_rows(x.index_select(0, order), counts,
                                       None if split is None else split.take(order))
        return out

    def _expert_rows(self, x: torch.Tensor, counts: list[int],
                     split: SplitRows | None = None) -> torch.Tensor:
        """Unweighted expert outputs of rows sorted by local expert, ``counts[e]``
        rows for expert ``e``: two matmuls per expert hit (float: into one
        buffer each; packed: ``ExpertRows``), one activation over every row."""
        packed = None
        if self.gate_up_t is None or self.down_t is None:
            packed = ExpertRows(counts, x.device, split)
        gate_up = _project(x, self.gate_up, self.gate_up_t, counts, packed)
        act = F.silu(gate_up[:, :self.rows]).mul_(gate_up[:, self.rows:])
        return _project(act, self.down, self.down_t, counts, packed)


def _transposed(weights: Experts) -> list[torch.Tensor] | None:
    return [w.t() for w in weights.unbind(0)] if isinstance(weights, torch.Tensor) else None


def _out_features(weights: Experts) -> int:
    return int(weights.shape[1]) if isinstance(weights, torch.Tensor) \
        else weights[0].out_features


def _project(x: torch.Tensor, weights: Experts, transposed: list[torch.Tensor] | None,
             counts: list[int], packed: ExpertRows | None) -> torch.Tensor:
    """Rows ``x`` sorted by expert through their experts' weights (one projection)."""
    if transposed is None:
        assert packed is not None and not isinstance(weights, torch.Tensor)
        return packed.matmul(x, weights)
    out = x.new_empty((x.shape[0], transposed[0].shape[1]))
    xs, outs = x.split_with_sizes(counts), out.split_with_sizes(counts)
    for expert, count in enumerate(counts):
        if count:
            torch.mm(xs[expert], transposed[expert], out=outs[expert])
    return out
