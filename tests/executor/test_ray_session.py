"""Which Ray an executor uses: the configured cluster, else RAY_ADDRESS, else
a new local one - never a cluster that `ray start` happened to leave running."""

from __future__ import annotations

import types
from typing import Any

import pytest

from mpexec.executor.ray import cluster as ray_cluster
from mpexec.executor.ray.cluster import RaySession


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    state = {"up": False}

    def init(**kwargs: Any) -> None:
        calls.append(kwargs)
        state["up"] = True

    def shutdown() -> None:
        state["up"] = False

    ray = types.SimpleNamespace(init=init, shutdown=shutdown,
                                is_initialized=lambda: state["up"])
    monkeypatch.setattr(ray_cluster, "import_ray", lambda: ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_no_address_starts_a_local_ray_of_its_own(fake_ray: list[dict[str, Any]]) -> None:
    session = RaySession.open(None)
    assert session.started and fake_ray[0]["address"] == "local"
    session.close()
    assert not session.ray.is_initialized()


@pytest.mark.parametrize(("configured", "env", "joined"), [
    ("10.0.0.1:6379", None, "10.0.0.1:6379"),
    (None, "10.0.0.2:6379", "10.0.0.2:6379"),
    ("10.0.0.1:6379", "10.0.0.2:6379", "10.0.0.1:6379"),  # the config wins
])
def test_an_address_joins_that_cluster_and_leaves_it_running(
        fake_ray: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
        configured: str | None, env: str | None, joined: str) -> None:
    if env is not None:
        monkeypatch.setenv("RAY_ADDRESS", env)
    session = RaySession.open(configured)
    assert not session.started and fake_ray[0]["address"] == joined
    assert "num_cpus" not in fake_ray[0]  # Ray refuses it when joining
    session.close()
    assert session.ray.is_initialized()  # not ours to stop


class _FakeCluster:
    """What never_satisfiable reads of Ray: totals and the live nodes."""

    def __init__(self, nodes: list[dict[str, float]]) -> None:
        self._nodes = nodes

    def cluster_resources(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for res in self._nodes:
            for name, amount in res.items():
                total[name] = total.get(name, 0.0) + amount
        return total

    def nodes(self) -> list[dict[str, Any]]:
        return [{"Alive": True, "Resources": res} for res in self._nodes] + [
            {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]  # a dead node counts not


@pytest.mark.parametrize(("nodes", "device", "workers", "why"), [
    ([{"CPU": 16.0}], "cuda", 2, "GPU 2 needed, 0 in the cluster"),
    ([{"CPU": 2.0}], "cpu", 3, "CPU 3 needed, 2 in the cluster"),
    ([{"CPU": 4.0}, {"GPU": 2.0}], "cuda", 2, "no node has {'CPU': 1.0, 'GPU': 1.0}"),
    ([{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}], "cuda", 2, None),
    ([{"CPU": 2.0}], "cpu", 2, None),
])
def test_a_placement_that_can_never_fit_is_named(nodes: list[dict[str, float]], device: str,
                                                 workers: int, why: str | None) -> None:
    bundles = ray_cluster.bundles_for(workers, device)
    reason = ray_cluster.never_satisfiable(_FakeCluster(nodes), bundles)
    if why is None:
        assert reason is None
    else:
        assert reason is not None and why in reason
