"""Every collective of every group, on forked ranks, against one-process references.

Each layout runs once per path: shared memory (the default for CPU tensors
on one node) and gloo (``use_shared_memory=False``).  The ranks compute
their inputs from (rank, group, size) with a seeded generator, so the test
process recomputes every input and every expected result by itself.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mpexec.layout import DIMENSIONS, ParallelLayout  # noqa: E402
from tests.distributed.spmd import run_ranks  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(180)]

GROUPS = ("world", *DIMENSIONS)
# 5000 float32 outgrow the first 16 KiB slots (the segment regrows); 131075 float32
# (just over 512 KiB) take the two-phase all_reduce, in chunks that do not divide evenly.
SIZES = (1, 576, 5000, 131_075)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_input(rank: int, group: str, n: int, dtype: str) -> Any:
    seed = (rank * 1000 + GROUPS.index(group) * 37 + n) * 11 + len(dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(DTYPES[dtype])


def gather_input(rank: int, group_rank: int) -> Any:
    # uneven along dim 1: group rank i sends i + 1 columns
    return torch.arange(2 * (group_rank + 1) * 3, dtype=torch.float32).reshape(
        2, group_rank + 1, 3) + 100 * rank


def a2a_input(rank: int, group_rank: int, world: int, extra: int) -> tuple[Any, list[int]]:
    # group rank i sends (i + p) % 3 (+ extra) rows of 3 to group rank p: some none
    splits = [(group_rank + p) % 3 + extra for p in range(world)]
    rows = [torch.tensor([rank, p, j], dtype=torch.float32)
            for p in range(world) for j in range(splits[p])]
    x = torch.stack(rows) if rows else torch.empty(0, 3)
    return x, splits


def layout_kwargs(layout: ParallelLayout) -> dict[str, Any]:
    return {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
            "prefill_context_model_parallel_size": layout.pcp,
            "decode_context_model_parallel_size": layout.dcp,
            "data_parallel_size": layout.dp, "enable_expert_parallel": layout.enable_ep}


def exercise(rank: int, world_size: int, init_method: str, layout: ParallelLayout,
             use_shm: bool) -> dict[str, Any]:
    import mpexec.distributed as d

    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")
    d.init_distributed_environment(world_size, rank, rank, init_method, "gloo")  # idempotent
    d.initialize_model_parallel(**layout_kwargs(layout), use_shared_memory=use_shm)
    assert d.model_parallel_is_initialized()
    getters = {"world": d.get_world_group, "tp": d.get_tp_group, "pp": d.get_pp_group,
               "pcp": d.get_pcp_group, "dcp": d.get_dcp_group, "dp": d.get_dp_group,
               "ep": d.get_ep_group}
    out: dict[str, Any] = {"name": d.parallel_worker_name()}
    for name, get in getters.items():
        group = get()
        res: dict[str, Any] = {
            "ranks": group.ranks, "rank_in_group": group.rank_in_group,
            "first": group.is_first_rank, "last": group.is_last_rank,
            "next": group.next_rank, "prev": group.prev_rank}
        # first use under inference mode, later ones outside it, one needing grad
        with torch.inference_mode():
            res["inference"] = group.all_reduce(torch.ones(3))
        res["grad"] = group.all_reduce(torch.ones(3, requires_grad=True)).detach()
        for n in SIZES:
            for dtype in DTYPES:
                res[f"sum{n}{dtype}"] = group.all_reduce(make_input(rank, name, n, dtype))
        x = gather_input(rank, group.rank_in_group)
        res["gather1"] = group.all_gather(x, dim=1)
        res["gather_last"] = group.all_gather(x.transpose(1, 2), dim=-1)
        res["gather0"] = group.all_gather(x.reshape(-1, 3), dim=0)
        res["gather_to_last"] = group.gather(x, dst=group.world_size - 1, dim=1)
        for extra in (0, 1000):  # 1000 rows outgrow the first slots
            res[f"a2a{extra}"] = group.all_to_all(
                *a2a_input(rank, group.rank_in_group, group.world_size, extra))
        res["broadcast"] = group.broadcast(torch.full((3,), float(rank)), src=group.world_size - 1)
        res["object"] = group.broadcast_object({"from": rank} if group.is_first_rank else None)
        group.barrier()
        res["shm"] = group.shm_active
        out[name] = res
    pp = d.get_pp_group()
    stage = pp.rank_in_group
    if pp.world_size > 1:
        # along the pipeline: each stage adds its stage number and passes on
        if pp.is_first_rank:
            hidden = {"hidden": torch.ones(16, 576),
                      "residual": torch.zeros(16, 576, dtype=torch.bfloat16),
                      "empty": torch.empty(0, 4), "step": 0}
        else:
            hidden = pp.recv_tensor_dict()
            hidden["hidden"].add_(0)  # what arrives is the receiver's own, writable memory
            out["received"] = hidden
        if not pp.is_last_rank:
            hidden = {k: v + 1 for k, v in hidden.items()}  # tensors and the step alike
            pp.send_tensor_dict(hidden)
            pp.send(torch.arange(4.0) + rank, pp.rank_in_group + 1)
            pp.send_object({"stage": stage}, pp.rank_in_group + 1)
        if not pp.is_first_rank:
            out["plain"] = pp.recv((4,), torch.float32, pp.rank_in_group - 1)
            out["object"] = pp.recv_object(pp.rank_in_group - 1)
        out["routes"] = pp.point_to_point_routes()
    d.destroy_model_parallel()
    d.destroy_model_parallel()  # idempotent
    d.destroy_distributed_environment()
    d.destroy_distributed_environment()
    return out


def reference_sum(ranks: list[int], group: str, n: int, dtype: str) -> Any:
    # the shared-memory path's order: rank 0 + rank 1, then + each next rank
    inputs = [make_input(r, group, n, dtype) for r in ranks]
    if len(inputs) == 1:
        return inputs[0]
    total = inputs[0] + inputs[1]
    for extra in inputs[2:]:
        total += extra
    return total


LAYOUTS = [
    ParallelLayout(),
    ParallelLayout(tp=2),
    ParallelLayout(tp=3),
    ParallelLayout(pp=2),
    ParallelLayout(tp=2, pp=2),
    ParallelLayout(tp=2, pcp=2),
    ParallelLayout(tp=2, dp=2, enable_ep=True),
    ParallelLayout(tp=4, dcp=2),
    ParallelLayout(tp=2, pp=2, dp=2, enable_ep=True),
    ParallelLayout(tp=2, pp=2, pcp=2),
]


def check(layout: ParallelLayout, results: list[dict[str, Any]], use_shm: bool) -> None:
    for rank, out in enumerate(results):
        for name in GROUPS:
            res = out[name]
            ranks = (list(range(layout.world_size)) if name == "world"
                     else layout.group_of(name, rank))
            assert res["ranks"] == ranks, (rank, name)
            i = ranks.index(rank)
            assert res["rank_in_group"] == i
            assert res["first"] == (i == 0) and res["last"] == (i == len(ranks) - 1)
            assert res["next"] == ranks[(i + 1) % len(ranks)]
            assert res["prev"] == ranks[(i - 1) % len(ranks)]
            # (the world group is built before use_shared_memory is known: always on)
            shm = (use_shm or name == "world") and len(ranks) > 1
            assert res["shm"] == shm, (rank, name)
            for n in SIZES:
                for dtype in DTYPES:
                    got, want = res[f"sum{n}{dtype}"], reference_sum(ranks, name, n, dtype)
                    assert got.dtype == DTYPES[dtype]
                    if shm or len(ranks) == 1:
                        assert torch.equal(got, want), (rank, name, n, dtype)
                    else:
                        tol = 1e-5 if dtype == "float32" else 5e-2
                        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
                    # every member holds the very same bits
                    peer = results[ranks[0]][name][f"sum{n}{dtype}"]
                    if shm:
                        assert torch.equal(got, peer)
            assert torch.equal(res["inference"], torch.full((3,), float(len(ranks))))
            assert torch.equal(res["grad"], torch.full((3,), float(len(ranks))))
            inputs = [gather_input(r, j) for j, r in enumerate(ranks)]
            assert torch.equal(res["gather1"], torch.cat(inputs, dim=1))
            assert torch.equal(res["gather_last"],
                               torch.cat([x.transpose(1, 2) for x in inputs], dim=-1))
            assert torch.equal(res["gather0"], torch.cat([x.reshape(-1, 3) for x in inputs]))
            if i == len(ranks) - 1:
                assert torch.equal(res["gather_to_last"], torch.cat(inputs, dim=1))
            else:
                assert res["gather_to_last"] is None
            for extra in (0, 1000):
                got, counts = res[f"a2a{extra}"]
                sent = [a2a_input(r, j, len(ranks), extra) for j, r in enumerate(ranks)]
                want = [x[sum(sp[:i]):sum(sp[:i + 1])] for x, sp in sent]
                assert counts == [sp[i] for _, sp in sent], (rank, name, extra)
                assert torch.equal(got, torch.cat(want)), (rank, name, extra)
            assert torch.equal(res["broadcast"], torch.full((3,), float(ranks[-1])))
            assert res["object"] == {"from": ranks[0]}
        coords = layout.coordinates(rank)
        stage = coords["pp"]
        if layout.pp > 1 and stage > 0:
            got = out["received"]
            assert got["step"] == stage
            assert torch.equal(got["hidden"], torch.full((16, 576), 1.0 + stage))
            assert got["residual"].dtype == torch.bfloat16
            assert torch.equal(got["residual"], torch.full((16, 576), float(stage),
                                                           dtype=torch.bfloat16))
            assert got["empty"].shape == (0, 4)
            prev = layout.group_of("pp", rank)[stage - 1]
            assert torch.equal(out["plain"], torch.arange(4.0) + prev)
            assert out["object"] == {"stage": stage - 1}
            assert out["routes"].get((prev, rank), "gloo") == ("shm" if use_shm else "gloo")
        if layout.pp > 1 and stage < layout.pp - 1:
            following = layout.group_of("pp", rank)[stage + 1]
            assert out["routes"].get((rank, following), "gloo") == ("shm" if use_shm else "gloo")
        expected_name = "Worker" + "".join(
            f"_{dim.upper()}{coords[dim]}" for dim in DIMENSIONS if layout.size(dim) > 1)
        assert out["name"] == expected_name


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_shared_memory_path(layout: ParallelLayout, leak_check: None) -> None:
    results = run_ranks(layout.world_size, exercise, layout, True)
    check(layout, results, use_shm=True)


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, pp=2),
                                    ParallelLayout(tp=2, dp=2, enable_ep=True),
                                    ParallelLayout(tp=3)], ids=str)
def test_gloo_path(layout: ParallelLayout, leak_check: None) -> None:
    results = run_ranks(layout.world_size, exercise, layout, False)
    check(layout, results, use_shm=False)


@pytest.mark.slow
def test_spawned_ranks(leak_check: None) -> None:
    # The executor starts workers with spawn by default: nothing may rely on fork.
    layout = ParallelLayout(tp=2)
    check(layout, run_ranks(2, exercise, layout, True, start_method="spawn", timeout=120),
          use_shm=True)
