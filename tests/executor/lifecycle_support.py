"""What the executor life-cycle tests share: where the repository is, the start
methods they run under, how long they wait, and how a child driver is run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mpexec.system import process_gone

ROOT = Path(__file__).resolve().parents[2]
START_METHODS = [pytest.param("fork"), pytest.param("spawn", marks=pytest.mark.slow)]
# The driver going away: a worker forked from the fork server has the server,
# not the driver, as its parent.
DRIVER_START_METHODS = [*START_METHODS, pytest.param("forkserver")]
WAIT_S = 30.0


def driver_env() -> dict[str, str]:
    """The environment of a child driver: it imports mpexec and tests from ROOT."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))


def wait_gone(pids: list[int], timeout: float = WAIT_S) -> bool:
    """True once every pid in ``pids`` has exited, False at ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(process_gone(p) for p in pids):
            return True
        time.sleep(0.02)
    return False
