"""``mpexec serve`` on the Ray backend and across two nodes on loopback.

Each test starts its own server on the tiny checkpoint (TP=2), drives it
with the real ``openai`` client (plain, streamed, several clients at once),
checks the greedy text against ``LLM.generate`` in this process, then sends
SIGTERM and proves that nothing is left: the server exits 0, and every
process it had (Ray's daemons and actors; the follower node and its worker)
is gone.
"""

from __future__ import annotations

import asyncio
import glob
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import descendants, ray_session_processes
from tests.entrypoints.server_proc import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.usefixtures("leak_check"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                 reason="TP=2 needs 2 CPUs")]

PROMPTS = [f"the quick brown fox {i} jumps over" for i in range(4)]
MAX_TOKENS = 10
GONE_TIMEOUT_S = 60.0


def offline_greedy(checkpoint: Path) -> list[str]:
    from mpexec import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(str(checkpoint), executor_backend="uni", num_threads=1) as llm:
        return [o.text for o in llm.generate(PROMPTS, params)]


def check_server_answers(server: ServerProcess, expected: list[str]) -> None:
    """Plain, streamed, and all prompts at once from concurrent streaming clients."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120,
                           max_retries=0)
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert out.choices[0].text == expected[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1],
                                            max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected[1]

    async def one(aclient: Any, prompt: str) -> str:
        stream = await aclient.completions.create(model="tiny", prompt=prompt,
                                                  max_tokens=MAX_TOKENS, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      timeout=120, max_retries=0) as aclient:
            return list(await asyncio.gather(*(one(aclient, p) for p in PROMPTS)))

    assert asyncio.run(all_at_once()) == expected


def wait_gone(pids: set[int], timeout: float = GONE_TIMEOUT_S) -> set[int]:
    """The pids still running (zombies count as gone) once ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {pid for pid in pids if _running(pid)}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_serve_on_the_ray_backend(tiny_checkpoint: Path) -> None:
    expected = offline_greedy(tiny_checkpoint)
    with ServerProcess(str(tiny_checkpoint), "--served-model-name", "tiny", "-tp", "2",
                       "--executor-backend", "ray", "--shutdown-grace", "2") as server:
        server.wait_ready()
        check_server_answers(server, expected)
        # Ray names its session after the driver's pid: the server's (the newest such
        # directory, should an earlier process with the same pid have left one).
        sessions = glob.glob(f"/tmp/ray/session_*_{server.proc.pid}")
        assert sessions, server.log()
        session = max(sessions, key=os.path.getmtime)
        ray_pids = ray_session_processes(session)
        actors = [p for p in ray_pids if _cmdline(p).startswith(b"ray::RayWorkerActor")]
        assert len(actors) == 2, server.log()
        tree = descendants(server.proc.pid) | ray_pids
        assert server.stop() == 0, server.log()
        assert not wait_gone(tree), server.log()
        assert not ray_session_processes(session)
        assert "Traceback" not in server.log()


def serve_beside_a_follower(checkpoint: Path, layout: list[str], follower_port_offset: int,
                            check_trees: Any) -> None:
    """``mpexec serve`` as node 0 of two beside a CLI follower (dialing
    master_port + ``follower_port_offset``): it answers as ``LLM.generate``,
    ``check_trees(leader_pids, follower_pids, server)`` looks at the
    processes, and SIGTERM leaves nothing: the leader exits 0, its goodbye
    ends the follower (exit 0)."""
    from tests.multinode.nodes import SECRET, free_port, reap, start_follower

    expected = offline_greedy(checkpoint)
    master_port = free_port()
    follower = start_follower(master_port + follower_port_offset, cli=True)
    try:
        with ServerProcess(str(checkpoint), "--served-model-name", "tiny", *layout,
                           "--nnodes", "2", "--node-rank", "0", "--master-port",
                           str(master_port), "--shutdown-grace", "2",
                           env={"MPEXEC_CLUSTER_SECRET": SECRET}) as server:
            server.wait_ready()
            check_server_answers(server, expected)
            leader_tree = descendants(server.proc.pid)
            follower_tree = descendants(follower.pid)
            check_trees(leader_tree, follower_tree, server)
            assert server.stop() == 0, server.log()
            assert follower.wait(GONE_TIMEOUT_S) == 0
            assert not wait_gone(leader_tree | follower_tree), server.log()
            assert "Traceback" not in server.log()
    finally:
        reap(follower)


def _workers(pids: set[int]) -> list[bytes]:
    """The titles of the mpexec workers among ``pids``."""
    return sorted(t.split(b"\0")[0] for t in map(_cmdline, pids)
                  if t.startswith(b"mpexec::Worker"))


def test_serve_across_two_nodes(tiny_checkpoint: Path) -> None:
    def check(leader: set[int], follower: set[int], server: ServerProcess) -> None:
        assert any(b"Worker" in _cmdline(p) for p in follower), server.log()

    serve_beside_a_follower(tiny_checkpoint, ["-tp", "2"], 0, check)


def test_serve_with_a_data_parallel_replica_on_another_node(tiny_checkpoint: Path) -> None:
    """``serve -dp 2 --nnodes 2``: replica 1's worker lives on the follower,
    which dials master_port + 1; the answers are one replica's."""
    def check(leader: set[int], follower: set[int], server: ServerProcess) -> None:
        # replica 1's worker on the follower, replica 0's here
        assert _workers(follower) == [b"mpexec::Worker_DP1"], server.log()
        assert _workers(leader) == [b"mpexec::Worker_DP0"], server.log()

    serve_beside_a_follower(tiny_checkpoint, ["-dp", "2"], 1, check)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
