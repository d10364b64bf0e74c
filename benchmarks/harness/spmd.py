"""Running one function on N forked ranks of a fresh torch.distributed world.

Shared by the collectives benchmark and the ``tests/distributed`` suite
(``tests/distributed/spmd.py`` re-exports it).

``run_ranks(world_size, fn, *args)`` forks ``world_size`` children; child
``r`` runs ``fn(r, world_size, init_method, *args)`` and pickles back what it
returns (or its traceback).  The rendezvous is a ``file://`` store in a
temporary directory, so no port can collide and nothing outlives the call.
Every wait is bounded by ``timeout``; on the way out every child is reaped
(killed if it must be).  Results come back as plain pickles over pipes, never
through torch's shared-memory tensor sharing.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

FORK = multiprocessing.get_context("fork")
SPAWN = multiprocessing.get_context("spawn")


class RankFailed(AssertionError):
    pass


def _child(fn: Callable[..., Any], rank: int, world_size: int, init_method: str,
           args: tuple[Any, ...], conn: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        payload = pickle.dumps(("ok", fn(rank, world_size, init_method, *args)))
    except BaseException:
        payload = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(payload)
    conn.close()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
              timeout: float = 60.0, expect_dead: frozenset[int] = frozenset(),
              start_method: str = "fork") -> list[Any]:
    """Per-rank results of ``fn``; ranks in ``expect_dead`` may die without a result.

    With ``start_method="spawn"``, ``fn`` must be importable by module path.
    """
    ctx = FORK if start_method == "fork" else SPAWN
    tmp = tempfile.mkdtemp(prefix="mpexec-dist-")
    init_method = f"file://{os.path.join(tmp, 'store')}"
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, name=f"rank{rank}",
                                args=(fn, rank, world_size, init_method, args, child_end))
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * world_size
        errors = []
        for rank, conn in enumerate(conns):
            remaining = max(deadline - time.monotonic(), 0)
            try:
                ready = conn.poll(remaining)
            except (EOFError, OSError):
                ready = False
            if not ready:
                if rank in expect_dead:
                    continue
                errors.append(f"rank {rank}: no result within {timeout} s")
                continue
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                if rank not in expect_dead:
                    errors.append(f"rank {rank}: died without a result "
                                  f"(exit code {procs[rank].exitcode})")
                continue
            if status == "error":
                errors.append(f"rank {rank} raised:\n{value}")
            results[rank] = value
        if errors:
            raise RankFailed("\n".join(errors))
        return results
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()
        for proc in procs:
            proc.close()
        shutil.rmtree(tmp, ignore_errors=True)
