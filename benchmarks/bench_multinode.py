"""Multi-node benchmarks on loopback: remote readers, broadcast bandwidth, failures.

Prints one table per measurement::

    python benchmarks/bench_multinode.py [--iters 2000] [--reps 3]

1. round trip of one small call and its reply between this process and a
   child process: raw ZeroMQ (PUB/SUB out, PUSH/PULL back, pickle both ways)
   next to mpexec's remote queues (HMAC-SHA256, sequence numbers and credit
   ACKs included) measured in the same run, and their ratio; then a no-op
   ``collective_rpc`` on TP=2 across two nodes (1 + 1 workers) next to TP=2
   on one node (shared memory);
2. 64 MiB broadcast to a remote reader in a child process: MB/s of a remote
   queue against a raw ZeroMQ zero-copy send of the same bytes;
3. SIGKILL of a follower's process tree -> ``WorkerDiedError`` at a caller
   blocked in a call on the leader;
4. SIGKILL of the leader's process tree -> no follower process left.

Everything runs on 127.0.0.1.  Numbers depend on the machine and its load;
compare within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# MPEXEC_SRC (default: this checkout's src) first: spawned children inherit
# sys.path, so both ends of a queue run the tree being measured.
SRC = os.environ.get("MPEXEC_SRC", str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, SRC)

import numpy  # noqa: E402
import zmq  # noqa: E402
from harness import free_ports, percentile, render  # noqa: E402

from mpexec.config import ExecutorConfig, ParallelConfig  # noqa: E402
from mpexec.errors import WorkerDiedError  # noqa: E402
from mpexec.executor import MultiprocExecutor  # noqa: E402
from mpexec.ipc import MessageQueue  # noqa: E402
from mpexec.system.procs import proc_stat  # noqa: E402

SECRET = "bench-cluster-secret-0123456789ab"
CALL = (1, "noop", (), {}, None)
REPLY = (1, True, None)
BIG = 64 << 20
WORKER = "tests.executor.workers:EchoWorker"


def _us(values: list[float]) -> tuple[float, float]:
    return percentile(values, 50) * 1e6, percentile(values, 99) * 1e6


# -- 1. round trips ------------------------------------------------------------------


def _raw_child(pub: str, pull: str, iters: int, big: bool) -> None:
    context = zmq.Context(1)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    push = context.socket(zmq.PUSH)
    push.connect(pull)
    push.send(b"hello")
    for _ in range(iters):
        if big:
            frames = sub.recv_multipart(copy=False)
            push.send(pickle.dumps(len(frames[1].buffer)))
        else:
            pickle.loads(sub.recv())
            push.send(pickle.dumps(REPLY))
    sub.close(0)
    push.close(0)
    context.term()


def raw_zmq(iters: int, big: bool = False, cpu: list[float] | None = None) -> list[float]:
    """Round-trip times; ``cpu`` collects this thread's CPU time per round trip."""
    context = zmq.Context(1)
    pub = context.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    pull = context.socket(zmq.PULL)
    pull_port = pull.bind_to_random_port("tcp://127.0.0.1")
    proc = multiprocessing.get_context("spawn").Process(
        target=_raw_child, args=(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{pull_port}",
                                 iters, big))
    proc.start()
    pull.recv()
    payload = bytearray(BIG) if big else None
    while True:  # PUB drops until the subscription has arrived: probe first
        pub.send_multipart([b"probe", b""]) if big else pub.send(pickle.dumps(None))
        if pull.poll(50):
            pull.recv()
            break
    samples = []
    for _ in range(iters - 1):
        t0, c0 = time.perf_counter(), time.thread_time()
        if big:
            pub.send_multipart([pickle.dumps(("big", BIG)), payload], copy=False)
        else:
            pub.send(pickle.dumps(CALL))
        pickle.loads(pull.recv())
        samples.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
    proc.join(30)
    pub.close(0)
    pull.close(0)
    context.term()
    return samples


def _queue_child(handle: Any, reply_conn: Any, iters: int, big: bool) -> None:
    calls = MessageQueue.create_from_handle(handle, 0, secret=SECRET)
    replies = MessageQueue(1, 0, secret=SECRET, name="reply")
    reply_conn.send(replies.export_handle())
    calls.wait_until_ready(30)
    replies.wait_until_ready(30)
    for _ in range(iters):
        message = calls.dequeue()
        replies.enqueue(len(message[1]) if big else REPLY)
    calls.shutdown()
    replies.shutdown()


def remote_queues(iters: int, big: bool = False, cpu: list[float] | None = None,
                  ) -> list[float]:
    """Round-trip times; ``cpu`` collects this thread's CPU time per round trip."""
    calls = MessageQueue(1, 0, secret=SECRET, name="calls")
    parent, child = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(
        target=_queue_child, args=(calls.export_handle(), child, iters, big))
    proc.start()
    replies = MessageQueue.create_from_handle(parent.recv(), 0, secret=SECRET)
    calls.wait_until_ready(30)
    replies.wait_until_ready(30)
    # An array comes back as a view of the received frame (no copy), as the
    # raw send's frame is only measured.
    payload = numpy.zeros(BIG, dtype=numpy.uint8) if big else None
    samples = []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.thread_time()
        calls.enqueue(("big", payload) if big else CALL)
        replies.dequeue()
        samples.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
    proc.join(30)
    calls.shutdown()
    replies.shutdown()
    return samples[1:]


def start_follower(port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MPEXEC_CLUSTER_SECRET": SECRET,
           "PYTHONPATH": os.pathsep.join([str(ROOT), SRC])}
    return subprocess.Popen([sys.executable, "-m", "mpexec", "node", "--nnodes", "2",
                             "--node-rank", "1", "--master-addr", "127.0.0.1",
                             "--master-port", str(port)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def two_node_config(port: int) -> ExecutorConfig:
    return ExecutorConfig(worker_cls=WORKER, device_type="cpu", cluster_secret=SECRET,
                          shutdown_grace_s=2.0, startup_timeout_s=60.0,
                          parallel=ParallelConfig(tensor_parallel_size=2, nnodes=2,
                                                  master_port=port))


def rpc_samples(executor: MultiprocExecutor, iters: int) -> list[float]:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        executor.collective_rpc("echo", args=(None,))
        samples.append(time.perf_counter() - t0)
    return samples[10:]


def bench_round_trip(iters: int) -> None:
    raw, ours = raw_zmq(iters), remote_queues(iters)
    rows = [["raw ZeroMQ PUB/SUB + PUSH/PULL", *(f"{v:.0f}" for v in _us(raw)), "1.00"],
            ["mpexec remote queues (HMAC, seq, credits)", *(f"{v:.0f}" for v in _us(ours)),
             f"{percentile(ours, 50) / percentile(raw, 50):.2f}"]]
    single = MultiprocExecutor(ExecutorConfig(worker_cls=WORKER, device_type="cpu",
                                              parallel=ParallelConfig(tensor_parallel_size=2)))
    try:
        shm = rpc_samples(single, iters)
    finally:
        single.shutdown()
    port = free_ports()
    follower = start_follower(port)
    try:
        multi = MultiprocExecutor(two_node_config(port))
        try:
            remote = rpc_samples(multi, iters)
        finally:
            multi.shutdown()
    finally:
        follower.wait(30)
    base = percentile(raw, 50)
    rows += [["collective_rpc no-op, TP=2 one node (shm)", *(f"{v:.0f}" for v in _us(shm)),
              f"{percentile(shm, 50) / base:.2f}"],
             ["collective_rpc no-op, TP=2 two nodes (1+1)", *(f"{v:.0f}" for v in _us(remote)),
              f"{percentile(remote, 50) / base:.2f}"]]
    print(render(f"1. round trip on loopback ({iters} calls; ratio = median / raw ZeroMQ)",
                 ["path", "median us", "p99 us", "ratio"], rows))


def bench_broadcast(reps: int) -> None:
    raw, ours = raw_zmq(reps + 1, big=True), remote_queues(reps + 1, big=True)

    def mbs(samples: list[float]) -> str:
        return f"{BIG / percentile(samples, 50) / 1e6:.0f}"

    print(render(f"2. 64 MiB to a reader in another process on loopback (median of {reps})",
                 ["path", "median ms", "MB/s"],
                 [["raw ZeroMQ zero-copy send", f"{percentile(raw, 50) * 1e3:.1f}", mbs(raw)],
                  ["mpexec remote queue (MAC over 64 MiB)", f"{percentile(ours, 50) * 1e3:.1f}",
                   mbs(ours)]]))


# -- 3, 4. failures ------------------------------------------------------------------


def tree_of(pid: int) -> set[int]:
    from tests.conftest import descendants

    return {pid} | descendants(pid)


def kill_tree(pids: set[int], first: int | None = None) -> None:
    """SIGKILL ``first`` (the tree's root), then the rest: a root killed after
    its children could still react to their deaths (end its peers in order)."""
    for p in sorted(pids, key=lambda p: p != first):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        stat = proc_stat(p)
        if stat is not None and not stat.exited:
            out.add(p)
    return out


def _call_until_died(executor: MultiprocExecutor, caught: threading.Event) -> None:
    try:
        executor.collective_rpc("sleep", args=(60,))
    except WorkerDiedError:
        caught.set()


def bench_follower_kill(reps: int) -> None:
    samples = []
    phase = random.Random(0)
    for _ in range(reps):
        port = free_ports()
        follower = start_follower(port)
        executor = MultiprocExecutor(two_node_config(port))
        try:
            caught = threading.Event()
            thread = threading.Thread(target=_call_until_died, args=(executor, caught))
            thread.start()
            # At a random point of the follower's heartbeat period (0.5 s):
            # a fixed delay would always kill it at the same phase.
            time.sleep(0.3 + phase.uniform(0.0, 0.5))
            t0 = time.perf_counter()
            kill_tree(tree_of(follower.pid), first=follower.pid)
            caught.wait(30)
            samples.append(time.perf_counter() - t0)
            thread.join(30)
        finally:
            executor.shutdown()
            follower.wait(30)
    print(render(f"3. SIGKILL of the follower's tree -> WorkerDiedError at the leader ({reps})",
                 ["median s", "max s"],
                 [[f"{percentile(samples, 50):.2f}", f"{max(samples):.2f}"]], left=0))


_LEADER = """
import sys, time
sys.path[:0] = [{root!r}, {src!r}, {bench!r}]
from benchmarks.bench_multinode import two_node_config
from mpexec.executor import MultiprocExecutor
if __name__ == "__main__":
    ex = MultiprocExecutor(two_node_config(int(sys.argv[1])))
    ex.collective_rpc("whoami")
    print("READY", flush=True)
    time.sleep(600)
"""


def bench_leader_kill(reps: int) -> None:
    samples = []
    script = Path(f"/tmp/mpexec-bench-leader-{os.getpid()}.py")
    script.write_text(_LEADER.format(root=str(ROOT), src=SRC,
                                     bench=str(ROOT / "benchmarks")))
    try:
        for _ in range(reps):
            port = free_ports()
            follower = start_follower(port)
            leader = subprocess.Popen([sys.executable, str(script), str(port)],
                                      start_new_session=True, stdout=subprocess.PIPE,
                                      cwd=str(ROOT))
            assert leader.stdout is not None
            if leader.stdout.readline().strip() != b"READY":
                raise RuntimeError("the leader did not start")
            followers = tree_of(follower.pid)
            t0 = time.perf_counter()
            kill_tree(tree_of(leader.pid), first=leader.pid)
            while alive(followers) and time.perf_counter() - t0 < 30:
                time.sleep(0.01)
            samples.append(time.perf_counter() - t0)
            leader.wait(10)
            leader.stdout.close()
            follower.wait(10)
    finally:
        script.unlink()
    print(render(f"4. SIGKILL of the leader's tree -> no follower process left ({reps})",
                 ["median s", "max s"],
                 [[f"{percentile(samples, 50):.2f}", f"{max(samples):.2f}"]], left=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="round trips per row")
    parser.add_argument("--reps", type=int, default=3, help="repetitions for 2-4")
    parser.add_argument("--only", default="1,2,3,4", help="which tables (1,2,3,4)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    for key, run in (("1", lambda: bench_round_trip(args.iters)),
                     ("2", lambda: bench_broadcast(args.reps)),
                     ("3", lambda: bench_follower_kill(args.reps)),
                     ("4", lambda: bench_leader_kill(args.reps))):
        if key in only:
            run()
            print()


if __name__ == "__main__":
    main()
