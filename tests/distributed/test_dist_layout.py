"""Which ranks form each group: the layout arithmetic as pure functions."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("torch")

from mpexec.config import ParallelConfig
from mpexec.executor.ranks import parallel_ranks
from mpexec.layout import DIMENSIONS, ParallelLayout

pytestmark = pytest.mark.torch


def layouts_up_to(max_world: int) -> list[ParallelLayout]:
    out = []
    for dp, pp, pcp, tp in itertools.product(range(1, 9), repeat=4):
        if dp * pp * pcp * tp > max_world:
            continue
        for dcp in (d for d in range(1, tp + 1) if tp % d == 0):
            for ep in (False, True):
                out.append(ParallelLayout(tp=tp, pp=pp, pcp=pcp, dcp=dcp, dp=dp, enable_ep=ep))
    return out


@pytest.mark.parametrize("layout", layouts_up_to(8), ids=str)
def test_groups_partition_the_world_and_match_coordinates(layout: ParallelLayout) -> None:
    world = set(range(layout.world_size))
    for dim in DIMENSIONS:
        groups = layout.groups(dim)
        members = [r for g in groups for r in g]
        assert sorted(members) == sorted(world), dim
        for group in groups:
            assert len(group) == layout.size(dim)
            # a rank's index in its group is its coordinate in that dimension
            for index, rank in enumerate(group):
                assert layout.coordinates(rank)[dim] == index, (dim, group)
            # the members differ in nothing but this dimension
            others = [d for d in ("dp", "pp", "pcp", "tp") if d != dim]
            if dim in ("dcp", "ep"):
                continue
            keys = {tuple(layout.coordinates(r)[d] for d in others) for r in group}
            assert len(keys) == 1


@pytest.mark.parametrize("layout", [x for x in layouts_up_to(8) if x.dp == 1], ids=str)
def test_agrees_with_the_executor_rank_arithmetic(layout: ParallelLayout) -> None:
    config = ParallelConfig(tensor_parallel_size=layout.tp, pipeline_parallel_size=layout.pp,
                            prefill_context_parallel_size=layout.pcp,
                            decode_context_parallel_size=layout.dcp,
                            enable_expert_parallel=layout.enable_ep)
    for rank in range(layout.world_size):
        expected = parallel_ranks(rank, config)
        got = layout.coordinates(rank)
        assert (got["tp"], got["pcp"], got["pp"], got["dcp"], got["dp"]) == (
            expected.tp, expected.pcp, expected.pp, expected.dcp, expected.dp)
        if layout.enable_ep:
            assert got["ep"] == expected.ep


def test_tp_by_pp() -> None:
    layout = ParallelLayout(tp=2, pp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3]]
    assert layout.groups("pp") == [[0, 2], [1, 3]]
    assert layout.groups("dp") == [[0], [1], [2], [3]]
    assert layout.groups("ep") == [[0], [1], [2], [3]]


def test_tp_by_pcp_by_pp() -> None:
    layout = ParallelLayout(tp=2, pcp=2, pp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pcp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_dcp_splits_each_tp_group_into_consecutive_blocks() -> None:
    layout = ParallelLayout(tp=4, pp=2, dcp=2)
    assert layout.groups("dcp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layout.coordinates(r)["dcp"] for r in range(4)] == [0, 1, 0, 1]


def test_ep_spans_dp_pcp_tp_within_a_stage() -> None:
    layout = ParallelLayout(tp=2, pp=2, dp=2, enable_ep=True)
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("ep") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [layout.coordinates(r)["ep"] for r in (0, 1, 4, 5)] == [0, 1, 2, 3]


def test_world_size_mismatch_names_the_numbers() -> None:
    layout = ParallelLayout(tp=2, pp=3)
    with pytest.raises(ValueError, match=r"world size 4 .*tensor_model_parallel_size \(2\).* = 6"):
        layout.check_world_size(4)


@pytest.mark.parametrize("kwargs, match", [
    ({"tp": 4, "dcp": 3}, "must divide"),
    ({"tp": 0}, "positive"),
    ({"pp": -1}, "positive"),
])
def test_bad_sizes(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


def test_unknown_dimension_and_rank() -> None:
    layout = ParallelLayout(tp=2)
    with pytest.raises(ValueError, match="unknown parallel dimension"):
        layout.groups("xp")
    with pytest.raises(ValueError, match="outside the world"):
        layout.coordinates(2)
