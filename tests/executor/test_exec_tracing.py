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
    # The real SDK may be imported already (other tests use it): set it aside,
    # so that this process and the workers it forks import the stand-in.
    real = {name: module for name, module in sys.modules.items()
            if name == "opentelemetry" or name.startswith("opentelemetry.")}
    for name in real:
        del sys.modules[name]
    yield
    for name in [n for n in sys.modules if n == "opentelemetry" or n.startswith("opentelemetry.")]:
        del sys.modules[name]
    sys.modules.update(real)


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


# -- one trace across processes, with the real OpenTelemetry SDK --------------------------

@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_one_trace_links_the_drivers_call_to_every_workers_span(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from tests.executor.trace_export import ENV, read_spans

    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv(ENV, str(path))
    config = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker",
                            parallel=ParallelConfig(tensor_parallel_size=2),
                            mp_start_method=method, trace=True,
                            trace_exporter="tests.executor.trace_export:file_exporter")
    with MultiprocExecutor(config) as ex:
        assert ex.collective_rpc("echo", args=(7,)) == [7, 7]
        pids = [w.pid for w in ex.workers]
    spans = read_spans(str(path))
    by_id = {s["span_id"]: s for s in spans}
    [call] = [s for s in spans if s["name"] == "executor.collective_rpc"]
    assert call["process"] == "Executor" and call["attributes"]["method"] == "echo"
    worker_calls = [s for s in spans if s["name"] == "worker.call"
                    and s["attributes"]["method"] == "echo"]
    assert sorted(s["pid"] for s in worker_calls) == sorted(pids)
    for span in worker_calls:  # each worker's span: a child of the driver's, same trace
        assert span["parent_id"] == call["span_id"] and span["trace_id"] == call["trace_id"]
    [start] = [s for s in spans if s["name"] == "executor.start"]
    worker_starts = [s for s in spans if s["name"] == "worker.start"]
    assert len(worker_starts) == 2
    for span in worker_starts:
        assert span["parent_id"] == start["span_id"] and span["trace_id"] == start["trace_id"]
        inner = [s for s in spans if s["parent_id"] == span["span_id"]]
        assert {s["name"] for s in inner} == {"worker.init_device", "worker.load_model"}
    assert all(s["parent_id"] is None or s["parent_id"] in by_id for s in spans)


def test_an_untraced_executor_beside_a_traced_one_records_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from tests.executor.trace_export import ENV, read_spans

    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv(ENV, str(path))
    traced = ExecutorConfig(worker_cls="tests.executor.workers:EchoWorker",
                            parallel=ParallelConfig(tensor_parallel_size=1), trace=True,
                            trace_exporter="tests.executor.trace_export:file_exporter")
    with MultiprocExecutor(traced) as ex:
        ex.collective_rpc("echo", args=(1,))
        before = len(read_spans(str(path)))
        with MultiprocExecutor(traced.replace(trace=False)) as plain:
            assert plain.collective_rpc("echo", args=(2,)) == [2]
        assert len(read_spans(str(path))) == before
