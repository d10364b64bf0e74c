"""The model on two nodes (two process trees on 127.0.0.1): decode speed and failures.

::

    python benchmarks/bench_multinode_model.py [--model PATH] [--tokens 48] [--reps 3]

1. time per output token (greedy, one prompt, after the first token) of the
   same model laid out five ways: TP=2 and PP=2 on one node; TP=2 split
   1 + 1 and PP=2 one stage per node with the nodes told apart by
   ``MPEXEC_NODE_ID`` (collectives through gloo over TCP, as between two
   hosts); TP=2 split 1 + 1 with the default identity (both trees on this
   host: shared memory between them);
2. SIGKILL of the follower's tree mid-generation -> ``WorkerDiedError`` out
   of ``generate`` on the leader;
3. SIGKILL of the leader's tree mid-generation -> no follower process left.

Without ``--model`` it writes the tiny test checkpoint (random weights, 4
layers).  Numbers depend on the machine and its load; compare within a run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import free_ports, percentile, render  # noqa: E402

from mpexec.system.procs import proc_stat  # noqa: E402

SECRET = "bench-cluster-secret-0123456789ab"
PROMPT = "the quick brown fox jumps over"


def child_env(node_id: str | None) -> dict[str, str]:
    env = {**os.environ, "MPEXEC_CLUSTER_SECRET": SECRET,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("MPEXEC_NODE_ID", None)
    if node_id is not None:
        env["MPEXEC_NODE_ID"] = node_id
    return env


def start_follower(port: int, node_id: str | None) -> subprocess.Popen[bytes]:
    code = ("import sys; from mpexec.executor.nodes.follower import run_follower; "
            f"sys.exit(run_follower(2, 1, '127.0.0.1', {port}, join_timeout_s=120))")
    return subprocess.Popen([sys.executable, "-c", code], env=child_env(node_id),
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def tree(pid: int) -> set[int]:
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and not stat.exited


def kill_tree(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def make_llm(model: str, tp: int, pp: int, **fields: Any) -> Any:
    from mpexec import LLM

    return LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
               executor_backend="mp", num_threads=1, max_num_batched_tokens=256,
               shutdown_grace_s=2.0, startup_timeout_s=120.0, **fields)


def per_token_s(llm: Any, tokens: int) -> float:
    from mpexec import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=tokens,
                                                ignore_eos=True))[0]
    m = out.metrics
    return float((m.finish_time - m.first_token_time) / (len(out.token_ids) - 1))


def decode_row(model: str, label: str, tp: int, pp: int, nodes: int, node_id: str | None,
               tokens: int, reps: int) -> list[str]:
    samples = []
    for _ in range(reps):
        if nodes == 1:
            with make_llm(model, tp, pp) as llm:
                samples.append(per_token_s(llm, tokens))
            continue
        port = free_ports()
        follower = start_follower(port, node_id and f"{node_id}-follower")
        if node_id is None:
            os.environ.pop("MPEXEC_NODE_ID", None)
        else:
            os.environ["MPEXEC_NODE_ID"] = f"{node_id}-leader"
        try:
            with make_llm(model, tp, pp, nnodes=2, master_port=port,
                          cluster_secret=SECRET) as llm:
                samples.append(per_token_s(llm, tokens))
            follower.wait(30)
        finally:
            os.environ.pop("MPEXEC_NODE_ID", None)
            kill_tree(tree(follower.pid))
            follower.wait(10)
    return [label, f"{percentile(samples, 50) * 1e3:.1f}", f"{max(samples) * 1e3:.1f}"]


def bench_follower_kill(model: str, reps: int) -> list[float]:
    from mpexec import SamplingParams, WorkerDiedError

    samples = []
    for _ in range(reps):
        port = free_ports()
        follower = start_follower(port, "kill-follower")
        os.environ["MPEXEC_NODE_ID"] = "kill-leader"
        try:
            llm = make_llm(model, 2, 1, nnodes=2, master_port=port, cluster_secret=SECRET,
                           execute_model_timeout_s=60.0)
            try:
                stream = llm.generate_stream(PROMPT, SamplingParams(
                    temperature=0, max_tokens=100000, ignore_eos=True))
                t0 = time.perf_counter()
                try:
                    for n, _ in enumerate(stream):
                        if n == 3:
                            kill_tree(tree(follower.pid))
                            t0 = time.perf_counter()
                except WorkerDiedError:
                    samples.append(time.perf_counter() - t0)
            finally:
                llm.shutdown()
        finally:
            os.environ.pop("MPEXEC_NODE_ID", None)
            kill_tree(tree(follower.pid))
            follower.wait(10)
    return samples


_LEADER = """
import sys
from mpexec import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM({model!r}, tensor_parallel_size=2, executor_backend="mp", num_threads=1,
              nnodes=2, master_port={port}, startup_timeout_s=120.0)
    params = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)
    while True:
        for n, _ in enumerate(llm.generate_stream({prompt!r}, params)):
            if n == 3:
                print("generating", flush=True)
"""


def bench_leader_kill(model: str, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        port = free_ports()
        follower = start_follower(port, "kill-follower")
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "leader.py"
            script.write_text(_LEADER.format(model=model, port=port, prompt=PROMPT))
            leader = subprocess.Popen([sys.executable, str(script)],
                                      env=child_env("kill-leader"), start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
            try:
                assert leader.stdout is not None
                if leader.stdout.readline() != "generating\n":
                    raise RuntimeError("the leader did not start generating")
                followers = tree(follower.pid)
                t0 = time.perf_counter()
                kill_tree(tree(leader.pid))
                deadline = time.monotonic() + 30
                while any(running(p) for p in followers) and time.monotonic() < deadline:
                    time.sleep(0.01)
                samples.append(time.perf_counter() - t0)
            finally:
                kill_tree(tree(leader.pid) | tree(follower.pid))
                leader.wait(10)
                follower.wait(10)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the tiny one)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per run (48)")
    parser.add_argument("--reps", type=int, default=3, help="runs per measurement (3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from mpexec.models.testing import write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "tiny"))
        rows = [decode_row(model, *layout, args.tokens, args.reps) for layout in (
            ("TP=2, one node", 2, 1, 1, None),
            ("TP=2 split 1+1, two nodes (gloo)", 2, 1, 2, "gloo"),
            ("TP=2 split 1+1, one host's identity (shm)", 2, 1, 2, None),
            ("PP=2, one node", 1, 2, 1, None),
            ("PP=2 one stage per node (gloo)", 1, 2, 2, "gloo"),
        )]
        print(render(f"1. time per output token, greedy, {args.tokens} tokens "
                     f"(median and max of {args.reps})", ["layout", "median ms", "max ms"],
                     rows))
        kills = bench_follower_kill(model, args.reps)
        gone = bench_leader_kill(model, args.reps)
    print()
    print(render(f"2-3. a node killed mid-generation (median and max of {args.reps})",
                 ["event", "median s", "max s"],
                 [["follower SIGKILL -> WorkerDiedError out of generate",
                   f"{percentile(kills, 50):.2f}", f"{max(kills):.2f}"],
                  ["leader SIGKILL -> no follower process left",
                   f"{percentile(gone, 50):.2f}", f"{max(gone):.2f}"]]))


if __name__ == "__main__":
    main()
