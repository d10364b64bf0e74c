"""RayExecutor figures: call paths against mp, and start-up/shutdown.

::

    python benchmarks/bench_ray.py [--iters 2000] [--ray-iters 300] [--big-reps 8]
                                   [--reps 3] [--call-reps 1]
    python benchmarks/bench_executor.py --ray ...   (the same tables)

1. no-op ``collective_rpc`` round trip at N = 1 and 2 workers: mp, ray with
   ``ray_call_path="shm"`` (mpexec's queues) and ``"ray"`` (actor calls), in
   one run, with each one's ratio to mp;
2. the same for a 64 MiB ``bytes`` argument (broadcast to every worker, each
   answers with its length);
3. start-up-to-ready and shutdown of a 2-worker ray executor, joining the
   Ray this script started, and once starting (and stopping) its own Ray.

Ray is started once (``num_cpus`` = this machine's CPUs) so that rows 1-3
do not pay for it; numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT / "src"), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)
# Ray's worker processes import the worker class from here.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])

from harness import percentile, render  # noqa: E402

from mpexec.config import ExecutorConfig, ParallelConfig  # noqa: E402
from mpexec.executor import Executor, WorkerBase  # noqa: E402

BIG = 64 << 20
VARIANTS = [("mp", "mp", {}), ("ray shm", "ray", {"ray_call_path": "shm"}),
            ("ray actor calls", "ray", {"ray_call_path": "ray"})]


class BenchWorker(WorkerBase):
    def noop(self) -> None:
        return None

    def size(self, payload: bytes) -> int:
        return len(payload)


def config(workers: int, backend: str, **fields: Any) -> ExecutorConfig:
    return ExecutorConfig(worker_cls="bench_ray:BenchWorker", device_type="cpu",
                          executor_backend=backend, startup_timeout_s=120.0,
                          parallel=ParallelConfig(tensor_parallel_size=workers), **fields)


def timed_calls(executor: Executor, iters: int, method: str, args: tuple[Any, ...] = ()
                ) -> list[float]:
    for _ in range(min(50, iters)):
        executor.collective_rpc(method, args=args)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        executor.collective_rpc(method, args=args)
        samples.append(time.perf_counter() - start)
    return samples


def bench_calls(iters: int, ray_iters: int, big_reps: int, call_reps: int = 1) -> None:
    """Each row ``call_reps`` times, the variants interleaved (load on a shared
    machine drifts): the median over reps of each rep's p50 and p99."""
    big = b"x" * BIG
    p50s: dict[tuple[int, str, str], list[float]] = {}
    p99s: dict[tuple[int, str, str], list[float]] = {}
    for _ in range(call_reps):
        for workers in (1, 2):
            for name, backend, fields in VARIANTS:
                cfg = config(workers, backend, **fields)
                with Executor.get_class(cfg)(cfg) as ex:
                    n = ray_iters if fields.get("ray_call_path") == "ray" else iters
                    for label, samples in (("noop", timed_calls(ex, n, "noop")),
                                           ("64 MiB", timed_calls(ex, big_reps, "size",
                                                                  (big,)))):
                        p50s.setdefault((workers, name, label), []).append(
                            percentile(samples, 50))
                        p99s.setdefault((workers, name, label), []).append(
                            percentile(samples, 99))
    rows: dict[str, list[list[str]]] = {"noop": [], "64 MiB": []}
    for (workers, name, label), values in p50s.items():
        p50 = percentile(values, 50)
        base = percentile(p50s[(workers, "mp", label)], 50)
        rows[label].append([str(workers), name, f"{p50 * 1e6:,.0f}",
                            f"{percentile(p99s[(workers, name, label)], 50) * 1e6:,.0f}",
                            f"{p50 / base:.2f}x"])
    reps = f", median of {call_reps} reps" if call_reps > 1 else ""
    print(render(f"no-op collective_rpc round trip (us{reps})",
                 ["N", "executor", "p50", "p99", "p50 / mp"], rows["noop"], left=2))
    print(render(f"64 MiB argument to every worker (us{reps})",
                 ["N", "executor", "p50", "p99", "p50 / mp"], rows["64 MiB"], left=2))


def bench_lifecycle(reps: int) -> None:
    rows = []
    for path in ("shm", "ray"):
        starts, stops = [], []
        for _ in range(reps):
            cfg = config(2, "ray", ray_call_path=path)
            t0 = time.perf_counter()
            ex = Executor.get_class(cfg)(cfg)
            t1 = time.perf_counter()
            ex.shutdown()
            starts.append(t1 - t0)
            stops.append(time.perf_counter() - t1)
        rows.append([f"{path}, joining a running Ray", f"{percentile(starts, 50):.2f}",
                     f"{percentile(stops, 50):.2f}"])
    own = own_ray_lifecycle()
    rows.append(["shm, starting its own Ray", *own])
    print(render(f"ray executor, 2 workers: start-up and shutdown (s, median of {reps}; "
                 "own Ray: 1 run)", ["case", "start-up", "shutdown"], rows))


def own_ray_lifecycle() -> list[str]:
    """In a fresh interpreter: no Ray yet, so the executor starts and stops one."""
    script = textwrap.dedent("""
        import time
        from bench_ray import config
        from mpexec.executor import Executor
        cfg = config(2, "ray")
        t0 = time.perf_counter(); ex = Executor.get_class(cfg)(cfg); t1 = time.perf_counter()
        ex.shutdown(); t2 = time.perf_counter()
        import ray; assert not ray.is_initialized()
        print(f"{t1 - t0:.2f} {t2 - t1:.2f}")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    return out[-2:]


def run(iters: int = 2000, ray_iters: int = 300, big_reps: int = 8, reps: int = 3,
        call_reps: int = 1) -> None:
    import ray

    print(f"mpexec ray benchmark: {os.cpu_count()} CPUs, ray {ray.__version__}")
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        bench_calls(iters, ray_iters, big_reps, call_reps)
        bench_lifecycle(reps)
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="no-op round trips (mp, shm)")
    parser.add_argument("--ray-iters", type=int, default=300,
                        help="no-op round trips on the actor-call path")
    parser.add_argument("--big-reps", type=int, default=8, help="64 MiB calls per row")
    parser.add_argument("--reps", type=int, default=3, help="start-ups per row")
    parser.add_argument("--call-reps", type=int, default=1,
                        help="repetitions of the call rows (medians over them)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(args.iters, args.ray_iters, args.big_reps, args.reps, args.call_reps)


if __name__ == "__main__":
    main()
