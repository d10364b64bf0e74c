"""The multi-node figures of ``bench_executor.py --remote``.

The measuring code is ``bench_multinode``'s; this module only picks the
figures issue 10 asks of the executor benchmark and prints them:

1. round trip of a small call and its reply through remote queues next to a
   raw ZeroMQ PUB/SUB + PUSH/PULL round trip in the same run (target: at most
   1.3x), and no-op ``collective_rpc`` on TP=2 over two nodes on loopback next
   to one node (shared memory);
2. 64 MiB to a remote reader against a raw ZeroMQ zero-copy send;
3. SIGKILL of a follower's tree -> ``WorkerDiedError``; SIGKILL of the
   leader's tree -> no follower process left (``--reps`` each).

``--remote-queues`` prints only the first two rows of 1 (no follower node is
started), so ``MPEXEC_SRC=<old tree>/src`` measures an older remote path
against this one in the same session, alternating.
"""

from __future__ import annotations

import statistics

import bench_multinode


def run(iters: int, reps: int, failures: bool = True) -> None:
    bench_multinode.bench_round_trip(iters)
    print()
    bench_multinode.bench_broadcast(reps)
    print()
    if failures:
        bench_multinode.bench_follower_kill(reps)
        print()
        bench_multinode.bench_leader_kill(reps)


def run_queues(iters: int) -> None:
    """Raw ZeroMQ vs remote queues only: one line, medians and their ratio
    (and the means: one round trip in every half window carries the ACKs;
    and the driver thread's CPU time per round trip, kernel time included)."""
    import mpexec

    raw_cpu: list[float] = []
    our_cpu: list[float] = []
    raw = bench_multinode.raw_zmq(iters, cpu=raw_cpu)
    ours = bench_multinode.remote_queues(iters, cpu=our_cpu)
    r, o = statistics.median(raw) * 1e6, statistics.median(ours) * 1e6
    rm, om = statistics.mean(raw) * 1e6, statistics.mean(ours) * 1e6
    rc, oc = statistics.mean(raw_cpu) * 1e6, statistics.mean(our_cpu[1:]) * 1e6
    print(f"{mpexec.__file__}: raw ZeroMQ {r:.0f} us, remote queues {o:.0f} us, "
          f"ratio {o / r:.2f} (means {rm:.0f} / {om:.0f} us, {om / rm:.2f}; "
          f"driver thread CPU {rc:.0f} / {oc:.0f} us)")
