"""An engine of disaggregated prefill in a process of its own (another "node").

``python -m tests.engine.peer_producer CHECKPOINT CONFIG_JSON READY_PATH``:
a producer (``kv_role`` in the config) computes the prompts of
``tests.engine.test_disagg_prefill`` (one token each), writes ``READY_PATH``
and serves their KV until its stdin closes (at most ``LIFETIME_S``), then
shuts down; a consumer generates them and then writes ``READY_PATH``.

The tests that start it wait for it with :func:`wait_for_file` (the ready
file, or the marker a stalling connector writes) and kill it mid-transfer
with :func:`kill_when_stalled`; every wait in both is bounded.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

LIFETIME_S = 110.0


def wait_for_file(process: subprocess.Popen[bytes], path: Path, *, timeout_s: float,
                  what: str, poll_s: float = 0.02) -> None:
    """Return once ``path`` exists; AssertionError if ``process`` (``what``)
    exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"{what} exited before writing {path.name}"
        assert time.monotonic() < deadline, f"{what} did not write {path.name} within " \
                                            f"{timeout_s:g} s"
        time.sleep(poll_s)


def kill_when_stalled(process: subprocess.Popen[bytes], marker: Path, *,
                      timeout_s: float = 100.0, what: str = "the peer") -> None:
    """SIGKILL ``process`` once the stall marker ``marker`` exists (a
    ``StallingPeerConnector`` writes it when it holds a transfer) and check it
    died of that signal.  Whatever happens, the process is dead and reaped and
    its stdin closed on return (each wait bounded: ``timeout_s`` for the
    marker, 10 s for the exit)."""
    try:
        wait_for_file(process, marker, timeout_s=timeout_s, what=what)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=10) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        if process.stdin is not None:
            process.stdin.close()


def main() -> None:
    checkpoint, config, ready = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    from mpexec import LLM, SamplingParams
    from tests.engine.test_disagg_prefill import PROMPTS, params

    with LLM(checkpoint, executor_backend="uni", num_threads=1, max_num_batched_tokens=64,
             block_size=4, kv_transfer_config=config) as llm:
        if config["kv_role"] == "kv_consumer":
            llm.generate(PROMPTS, params())
            ready.write_text("done")
            return
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
        ready.write_text("ready")
        select.select([sys.stdin], [], [], LIFETIME_S)


if __name__ == "__main__":
    main()
