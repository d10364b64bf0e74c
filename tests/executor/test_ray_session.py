"""Which Ray an executor uses: the configured cluster, else RAY_ADDRESS, else
a new local one - never a cluster that `ray start` happened to leave running."""

from __future__ import annotations

import types
from typing import Any

import pytest

from mpexec.executor import ray_cluster
from mpexec.executor.ray_cluster import RaySession


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
