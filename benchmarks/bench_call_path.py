"""The driver's own CPU per blocking call: a ``PendingCall`` recorded and its
replies collected by ``CallOrder``, with a reader that answers at once (no
processes, no queues), so only the record and the call order are measured.

``MPEXEC_SRC`` points at the ``src`` directory to measure (default: this
checkout's); run it alternately against two trees to compare::

    MPEXEC_SRC=/path/to/before/src python benchmarks/bench_call_path.py
    python benchmarks/bench_call_path.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("MPEXEC_SRC", str(ROOT / "src")))

from mpexec.executor.futures import CallOrder, PendingCall  # noqa: E402


class InstantReader:
    def __init__(self) -> None:
        self.call_id = 0

    def read_reply(self, rank: int, timeout: float | None) -> tuple[int, bool, Any]:
        return (self.call_id, True, None)

    def unread_reply(self, rank: int, reply: Any) -> None:
        raise AssertionError("not reached")


def main(calls: int = 200_000, reps: int = 7, ranks: tuple[int, ...] = (0, 1)) -> None:
    reader = InstantReader()
    order = CallOrder(reader)

    def finish(method: str, replies: dict[int, Any]) -> None:
        return None

    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for call_id in range(1, calls + 1):
            reader.call_id = call_id
            call = PendingCall(call_id, "noop", ranks, None, finish, None, 0.0)
            order.pending.append(call)
            order.resolve_own(call)
        best = min(best, (time.perf_counter() - t0) / calls)
    print(f"{best * 1e9:.0f} ns per blocking call (record + collect, {len(ranks)} ranks, "
          f"best of {reps} x {calls})")


if __name__ == "__main__":
    main()
