"""``DetachedGroup``: a gloo group outside any world, formed by generation.

Two members in threads of this process (gloo needs no world and no second
process): the collectives, a retired generation's ``StaleGroupError``, the
next generation on a fresh port, and a member that never comes as a
bounded ``DataParallelGroupError``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mpexec.distributed import DetachedGroup  # noqa: E402
from mpexec.distributed.detached import form_detached_group  # noqa: E402
from mpexec.errors import DataParallelGroupError, StaleGroupError  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(60)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def form(generation: int, port: int, size: int = 2, timeout_s: float = 20.0) -> list[Any]:
    """Every member of generation ``generation`` formed at once (one thread each)."""
    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(form_detached_group, "dp", host="127.0.0.1", port=port,
                               generation=generation, place=0, rank=rank, size=size,
                               host_store=rank == 0, timeout_s=timeout_s)
                   for rank in range(size)]
        return [f.result(timeout=40) for f in futures]


def on_each(groups: list[DetachedGroup], call: Callable[[DetachedGroup], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(groups)) as pool:
        return [f.result(timeout=40) for f in [pool.submit(call, g) for g in groups]]


def test_collectives_of_one_generation() -> None:
    groups = form(0, free_port())
    try:
        sums = on_each(groups, lambda g: g.all_reduce(torch.tensor([g.rank + 1.0])).item())
        # uneven sizes along the gathered dimension
        gathered = on_each(groups, lambda g: g.all_gather(
            torch.full((g.rank + 1, 2), float(g.rank)), dim=0).tolist())
        objects = on_each(groups, lambda g: g.all_gather_object({"rank": g.rank}))
        sent = on_each(groups, lambda g: g.broadcast_object("from 1" if g.rank else None, 1))
        tensors = on_each(groups, lambda g: g.broadcast(torch.tensor([g.rank * 7]), 1).item())
        on_each(groups, lambda g: g.barrier())
    finally:
        for group in groups:
            group.close()
    assert sums == [3.0, 3.0]
    assert gathered == [[[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]] * 2
    assert objects == [[{"rank": 0}, {"rank": 1}]] * 2
    assert sent == ["from 1", "from 1"] and tensors == [7, 7]
    assert [(g.generation, g.rank_in_group, g.world_size) for g in groups] == [(0, 0, 2),
                                                                               (0, 1, 2)]


def test_a_retired_generation_raises_and_the_next_one_forms() -> None:
    old = form(0, free_port())
    for group in old:
        group.retire("replaced by generation 1")
    with pytest.raises(StaleGroupError, match="generation 0 does not hold") as info:
        old[0].all_reduce(torch.ones(1))
    assert info.value.generation == 0
    new = form(1, free_port())
    try:
        assert on_each(new, lambda g: g.all_reduce(torch.ones(1)).item()) == [2.0, 2.0]
    finally:
        for group in new:
            group.close()
    unformed = DetachedGroup.unformed("dp", 0, 2, "not formed yet")
    with pytest.raises(StaleGroupError, match="no generation has formed yet"):
        unformed.barrier()


def test_a_member_that_never_comes_is_a_bounded_typed_error() -> None:
    with pytest.raises(DataParallelGroupError, match="did not form within 2 s"):
        form_detached_group("dp", host="127.0.0.1", port=free_port(), generation=3, place=0,
                            rank=0, size=2, host_store=True, timeout_s=2.0)
