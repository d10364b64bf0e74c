"""The SIGTERM backstop of a worker: a main thread blocked in native code
still ends on SIGTERM; a child forked from it does not set it off."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SETUP = """
import os, signal, sys, time
sys.path[:0] = [{root!r}, {src!r}]
from mpexec.executor.watcher import SignalBackstop
backstop = SignalBackstop()
def handler(signum, frame):
    backstop.handled()
    raise SystemExit(3)
signal.signal(signal.SIGTERM, handler)
backstop.install()
"""


def _run(body: str) -> subprocess.Popen[str]:
    code = _SETUP.format(root=str(ROOT), src=str(ROOT / "src")) + body
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(60)
def test_sigterm_ends_a_main_thread_blocked_in_native_code(leak_check: None) -> None:
    proc = _run("from tests.executor.workers import block_in_native_code\n"
                "print('blocking', flush=True)\n"
                "block_in_native_code()\n")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "blocking"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM  # the default action, not SIGKILL
        assert "SIGTERM not handled within 1.0 s" in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(60)
def test_a_forked_childs_sigterm_leaves_the_parent_alone(leak_check: None) -> None:
    proc = _run("pid = os.fork()\n"
                "if pid == 0:\n"
                "    time.sleep(30)\n"
                "    os._exit(0)\n"
                "time.sleep(0.2)\n"
                "os.kill(pid, signal.SIGTERM)\n"
                "print('child', os.waitpid(pid, 0)[1] >> 8, flush=True)\n"
                "time.sleep(2.0)\n"
                "print('parent alive', flush=True)\n")
    try:
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "child 3" in out and "parent alive" in out, out
    finally:
        proc.kill()
        proc.wait(10)
