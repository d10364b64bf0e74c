"""Tracing: spans around start-up and around every call, on both sides.

A stand-in ``opentelemetry`` package on disk records span names in memory,
so the test needs no OpenTelemetry install and works under fork and spawn.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.executor.multiproc import MultiprocExecutor

pytestmark = pytest.mark.usefixtures("leak_check")

FAKE_TRACE = textwrap.dedent("""
    import contextlib
    spans = []

    class _Tracer:
        def __init__(self, name):
            self.name = name

        @contextlib.contextmanager
        def start_as_current_span(self, name, attributes=None):
            spans.append((self.name, name, dict(attributes or {})))
            yield

    def get_tracer(name):
        return _Tracer(name)
""")


@pytest.fixture
def fake_opentelemetry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    package = tmp_path / "opentelemetry"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "trace.py").write_text(FAKE_TRACE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    yield
    for name in ("opentelemetry", "opentelemetry.trace"):
        sys.modules.pop(name, None)


def worker_spans(worker: Any) -> list[tuple[str, str, dict[str, Any]]]:
    from opentelemetry import trace  # the stand-in, in the worker's process

    return list(trace.spans)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_spans_around_startup_and_calls(fake_opentelemetry: Any, method: str) -> None:
    config = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker",
                            parallel=ParallelConfig(tensor_parallel_size=2),
                            mp_start_method=method, trace=True)
    with MultiprocExecutor(config) as ex:
        assert ex.collective_rpc("echo", args=(7,)) == [7, 7]
        per_worker = ex.collective_rpc(worker_spans)
    from opentelemetry import trace

    driver = [name for _, name, _ in trace.spans]
    assert driver.count("executor.collective_rpc") == 2
    assert "executor.start" in driver
    for rank, spans in enumerate(per_worker):
        names = [name for _, name, _ in spans]
        assert {"worker.start", "worker.init_device", "worker.load_model"} <= set(names)
        calls = [attrs for _, name, attrs in spans if name == "worker.call"]
        assert calls[0]["method"] == "echo" and calls[0]["rank"] == rank
        assert calls[-1]["method"] == "callable"


def test_tracing_is_per_executor(fake_opentelemetry: Any) -> None:
    """A traced executor does not switch tracing on for a later, untraced one."""
    traced = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker", trace=True)
    with MultiprocExecutor(traced) as ex:
        assert ex.tracer.enabled
    from opentelemetry import trace

    before = len(trace.spans)
    plain = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker")
    with MultiprocExecutor(plain) as ex:
        assert not ex.tracer.enabled
        assert ex.collective_rpc("echo", args=(1,)) == [1]
        (spans,) = ex.collective_rpc(worker_spans)
        # A forked worker inherits the driver's recorded spans, none of its own.
        assert [name for _, name, _ in spans if name.startswith("worker.")] == []
    assert len(trace.spans) == before
