"""RayExecutor on a real local Ray (num_cpus=2): the executor conformance cases.

Ray is started once for the module (it takes seconds on a busy machine) and
every executor joins it, so none of them stops it.  Every test runs under
``ray_leak_check`` (tests/conftest.py: no process, fd, memfd or mapping of
the test outlives it beyond Ray's own pooled processes) and ends with no
live actor and no placement group; the module's teardown checks that once
it has stopped Ray no Ray process is left.  Both call paths run the same
cases (``ray_support.check_calls``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
from tests.conftest import stop_process
from tests.executor.ray_support import (
    check_calls,
    live_actors,
    live_groups,
    ray_processes_left,
    ray_session_dir,
    start,
    warm_up,
)

from mpexec.errors import WorkerDiedError, WorkerStalledError, WorkerStartupError
from mpexec.outputs import ModelRunnerOutput, SchedulerOutput

ray = pytest.importorskip("ray")

from mpexec.executor.ray import RayExecutor  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]
PATHS = ["shm", "ray"]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    session = ray_session_dir()
    warm_up(*PATHS)
    yield
    assert live_actors() == [] and live_groups() == []
    ray.shutdown()
    assert ray_processes_left(session) == set()


@pytest.fixture
def made(ray_leak_check: None) -> Iterator[list[RayExecutor]]:
    executors: list[RayExecutor] = []
    yield executors
    for executor in executors:
        executor.shutdown()
    assert live_actors() == [] and live_groups() == []


@pytest.mark.parametrize("path", PATHS)
def test_calls_results_errors_and_stats(made: list[RayExecutor], path: str) -> None:
    check_calls(start(made, path))


@pytest.mark.parametrize("path", PATHS)
def test_pipeline_stages_and_step_methods(made: list[RayExecutor], path: str) -> None:
    ex = start(made, path, tp=1, pp=2)
    assert ex.output_rank == 1 and ex.max_concurrent_batches == 2
    out = ex.execute_model(SchedulerOutput(step=3, scheduled_tokens={"r": [1]}))
    assert isinstance(out, ModelRunnerOutput) and out.sampled_token_ids == [[1, 3]]
    assert ex.sample_tokens(None).sampled_token_ids == [[1]]
    assert ex.take_draft_token_ids().draft_token_ids == [[1]]


@pytest.mark.parametrize(("path", "calls"), [("shm", 10_000), ("ray", 2_000)])
def test_pipelined_non_block_calls_resolve_in_order(made: list[RayExecutor], path: str,
                                                    calls: int) -> None:
    ex = start(made, path, mq_max_chunks=4)
    futures = [ex.collective_rpc("echo", args=(i,), non_block=True) for i in range(calls)]
    assert futures[-1].result(timeout=150) == [calls - 1] * 2
    assert [f.result(timeout=0)[0] for f in futures] == list(range(calls))


@pytest.mark.parametrize(("path", "how"), [("shm", "pid"), ("shm", "ray.kill"),
                                           ("ray", "pid"), ("ray", "ray.kill")])
def test_actor_killed_mid_call(made: list[RayExecutor], path: str, how: str) -> None:
    ex = start(made, path)
    fired: list[int] = []
    done = threading.Event()
    ex.register_failure_callback(lambda: fired.append(1))
    # Callbacks add up, as on mp and uni: both run, once, in order.
    ex.register_failure_callback(lambda: (fired.append(2), done.set()))
    pending = ex.collective_rpc("sleep", args=(60.0,), non_block=True)
    victim = ex.workers[1]
    if how == "pid":
        os.kill(victim.pid, signal.SIGKILL)
    else:
        ray.kill(victim.actor)
    with pytest.raises(WorkerDiedError, match="rank 1") as info:
        pending.result(timeout=60)
    assert "node" in str(info.value) and info.value.rank == 1
    assert done.wait(30) and ex.is_failed
    with pytest.raises(WorkerDiedError, match="rank 1"):
        ex.collective_rpc("echo", args=(1,))
    ex.shutdown()
    assert fired == [1, 2]


@pytest.mark.parametrize("path", PATHS)
def test_an_actor_stopped_mid_call_is_named_within_its_bound(made: list[RayExecutor],
                                                            path: str) -> None:
    """SIGSTOP: Ray still sees the actor alive.  The driver watches the actors
    on its own Ray node (``stall``): state T past worker_stopped_timeout_s, so
    the actor is killed and the call fails with WorkerStalledError naming the
    rank, long before the call's 120 s."""
    ex = start(made, path, worker_stopped_timeout_s=1.0)
    fired = threading.Event()
    ex.register_failure_callback(fired.set)
    pending = ex.collective_rpc("sleep", args=(120.0,), non_block=True)
    victim = ex.workers[1]
    stop_process(victim.pid)
    with pytest.raises(WorkerStalledError, match=rf"rank 1 \(pid {victim.pid}\) has been "
                       r"stopped .*worker_stopped_timeout_s=1") as info:
        pending.result(timeout=60)
    assert info.value.rank == 1 and info.value.seen == "stopped"
    assert fired.wait(30) and ex.is_failed
    with pytest.raises(WorkerStalledError, match="rank 1"):
        ex.collective_rpc("echo", args=(1,))


@pytest.mark.parametrize("path", PATHS)
def test_worker_constructor_failure(made: list[RayExecutor], path: str) -> None:
    with pytest.raises(WorkerStartupError, match=r"rank 1.*boom in init"):
        start(made, path, worker_kwargs={"fail_at": "init:raise", "fail_rank": 1})
    assert live_actors() == [] and live_groups() == []


def test_actor_process_exits_during_start(made: list[RayExecutor]) -> None:
    with pytest.raises(WorkerStartupError, match=r"rank 0 died during start-up.*node"):
        start(made, "shm", worker_kwargs={"fail_at": "load_model:exit", "fail_rank": 0})
    assert live_actors() == [] and live_groups() == []


def test_unsatisfiable_placement_group_fails_at_once_naming_the_missing_cpus(
        made: list[RayExecutor]) -> None:
    # A timeout longer than the test's own: only failing at once can pass.
    with pytest.raises(WorkerStartupError, match=r"can never be placed.*CPU 3 needed, 2 in the "
                                                 r"cluster"):
        start(made, "shm", tp=3, ray_placement_timeout_s=3600.0)
    with pytest.raises(WorkerStartupError, match=r"can never be placed.*GPU 2 needed, 0 in the "
                                                 r"cluster"):
        start(made, "shm", tp=2, ray_placement_timeout_s=3600.0, device_type="cuda")
    assert live_groups() == []


def test_placement_that_could_succeed_later_waits_its_timeout(made: list[RayExecutor]) -> None:
    start(made, "shm", tp=2)  # holds both CPUs of the module's Ray
    with pytest.raises(WorkerStartupError, match=r"within 1s.*CPU 1 needed, 2 in the cluster "
                                                 r"\(0 free\)"):
        start(made, "shm", tp=1, ray_placement_timeout_s=1.0)


@pytest.mark.parametrize("path", PATHS)
def test_a_start_waiting_for_its_actors_gives_up_when_cancelled(made: list[RayExecutor],
                                                                 path: str) -> None:
    """Rank 0 hangs in load_model (60 s) under a 600 s startup_timeout_s;
    another thread sets the cancel event: the start raises at once, its actors
    and placement group gone."""
    cancel = threading.Event()
    timer = threading.Timer(1.0, cancel.set)
    timer.start()
    try:
        with pytest.raises(WorkerStartupError, match="start-up was cancelled"):
            start(made, path, cancel=cancel, startup_timeout_s=600.0,
                  worker_kwargs={"fail_at": "load_model:hang", "fail_rank": 0})
    finally:
        timer.cancel()
    assert live_actors() == [] and live_groups() == []


def test_a_start_cancelled_before_it_begins_starts_nothing(made: list[RayExecutor]) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(WorkerStartupError, match="start-up was cancelled"):
        start(made, "shm", cancel=cancel)
    assert live_actors() == [] and live_groups() == []


@pytest.mark.torch
def test_model_worker_at_tp2_gives_the_tokens_of_mp(made: list[RayExecutor],
                                                    tmp_path_factory: pytest.TempPathFactory
                                                    ) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from tests.models.model_run_driver import StepDriver, make_executor

    from mpexec.models.testing import write_tiny_checkpoint
    from mpexec.outputs import SamplingParams

    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")
    g = torch.Generator().manual_seed(11)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    requests = {f"r{i}": (torch.randint(4, 389, (5 + 4 * i,), generator=g).tolist(), greedy)
                for i in range(2)}
    runs = {}
    for backend in ("mp", "ray"):
        with make_executor(checkpoint, tp=2, backend=backend) as executor:
            if backend == "ray":
                assert isinstance(executor, RayExecutor)
            runs[backend] = StepDriver(executor).generate(requests)
    assert {rid: run.output for rid, run in runs["ray"].items()} == {
        rid: run.output for rid, run in runs["mp"].items()}
    assert all(len(run.output) == 8 for run in runs["ray"].values())


@pytest.mark.slow
def test_an_executor_without_ray_starts_and_stops_its_own(ray_leak_check: None) -> None:
    """In a fresh interpreter (this one runs the module's Ray): after shutdown()
    the Ray the executor started is stopped and its processes are gone."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, time, ray
        from tests.executor.conftest import make_config
        from mpexec.executor import Executor
        cfg = make_config(2, executor_backend="ray", device_type="cpu", startup_timeout_s=120.0)
        ex = Executor.get_class(cfg)(cfg)
        assert ex.session.started and ex.collective_rpc("echo", args=(5,)) == [5, 5]
        ex.shutdown()
        assert not ray.is_initialized()
        print("ok", os.getpid())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=170, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "ok"  # its Ray processes: the module teardown checks


def test_ray_leak_check_sees_an_actor_left_behind(made: list[RayExecutor]) -> None:
    """The allowance of ray_leak_check is Ray's idle processes only: a live
    actor process counts, even one Ray had pooled before (so the fixture is
    not vacuous)."""
    from tests.conftest import _leftovers, descendants, is_pooled_ray_process, open_fds

    before = descendants(os.getpid())
    ex = start(made, "shm", tp=1)
    left, _, _ = _leftovers(before, open_fds(), set(), is_pooled_ray_process)
    assert ex.workers[0].pid in left


WORKER_MODULE = '''
from mpexec.executor.worker_base import WorkerBase


class PathWorker(WorkerBase):
    def where(self):
        return __file__
'''


@pytest.fixture
def module_on_sys_path(tmp_path_factory: pytest.TempPathFactory,
                       monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A worker module importable only through a sys.path entry of this driver."""
    directory = tmp_path_factory.mktemp("driver_code")
    name = f"mpexec_path_worker_{os.getpid()}"
    (directory / f"{name}.py").write_text(WORKER_MODULE)
    monkeypatch.syspath_prepend(str(directory))
    yield name
    import sys

    sys.modules.pop(name, None)


@pytest.mark.parametrize("as_class", [False, True])
def test_a_worker_module_on_the_drivers_sys_path_imports_in_the_actors(
        made: list[RayExecutor], module_on_sys_path: str, as_class: bool) -> None:
    import importlib

    from mpexec.executor.ray.cluster import actor_runtime_env

    cls: object = f"{module_on_sys_path}:PathWorker"
    if as_class:
        cls = importlib.import_module(module_on_sys_path).PathWorker
    ex = start(made, "shm", worker_cls=cls)
    where = ex.collective_rpc("where")
    assert all(w.endswith(f"{module_on_sys_path}.py") for w in where)
    assert actor_runtime_env(ex.session) is not None  # the directory had to travel


def test_a_worker_module_the_actors_cannot_import_is_named(
        made: list[RayExecutor], module_on_sys_path: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.executor.ray import executor as ray_executor

    monkeypatch.setattr(ray_executor, "actor_runtime_env", lambda session: None)
    with pytest.raises(WorkerStartupError) as info:
        start(made, "shm", worker_cls=f"{module_on_sys_path}:PathWorker")
    text = str(info.value)
    assert f"module '{module_on_sys_path}' is not importable in the Ray actor" in text
    assert f"{module_on_sys_path}.py" in text and "PYTHONPATH" in text
    assert live_actors() == [] and live_groups() == []


TRACE_MODULE = '''
from tests.executor.trace_export import FileSpanExporter


def exporter():
    return FileSpanExporter({path!r})
'''


@pytest.mark.parametrize("path", PATHS)
def test_one_trace_links_the_drivers_call_to_every_actors_span(
        made: list[RayExecutor], tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from tests.executor.trace_export import read_spans

    # The exporter's module lives only on this driver's sys.path: it reaches
    # the actors through their PYTHONPATH, and names the file in its code.
    directory = tmp_path_factory.mktemp("trace_code")
    spans_file = directory / "spans.jsonl"
    name = f"mpexec_trace_exporter_{path}_{os.getpid()}"
    (directory / f"{name}.py").write_text(TRACE_MODULE.format(path=str(spans_file)))
    monkeypatch.syspath_prepend(str(directory))
    ex = start(made, path, trace=True, trace_exporter=f"{name}:exporter")
    assert ex.collective_rpc("echo", args=(3,)) == [3, 3]
    pids = sorted(w.pid for w in ex.workers)
    ex.shutdown()
    spans = read_spans(str(spans_file))
    [call] = [s for s in spans if s["name"] == "executor.collective_rpc"
              and s["attributes"]["method"] == "echo"]
    children = [s for s in spans if s["name"] == "worker.call"
                and s["attributes"]["method"] == "echo"]
    assert sorted(s["pid"] for s in children) == pids
    assert all(s["parent_id"] == call["span_id"] and s["trace_id"] == call["trace_id"]
               for s in children)
