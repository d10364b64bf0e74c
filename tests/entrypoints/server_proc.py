"""Start ``python -m mpexec serve ...`` on a free port and wait (bounded) until it serves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"mpexec-serve-{self.port}.log"
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "src"), str(ROOT), full_env.get("PYTHONPATH", "")])
        full_env.setdefault("MPEXEC_SHUTDOWN_GRACE_SECONDS", "2")
        full_env.update(env or {})
        self._stderr = open(self.stderr_path, "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mpexec", "serve", model, "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL, stderr=self._stderr, env=full_env, cwd=ROOT)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not become healthy in {timeout} s: {self.log()}")

    def log(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_bytes().decode(errors="replace")[-4000:]

    def worker_pids(self) -> list[int]:
        from tests.conftest import descendants

        return sorted(descendants(self.proc.pid))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Signal the server and wait for its exit status (killed at the deadline)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise
        finally:
            self._stderr.close()
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if not self._stderr.closed:
            self._stderr.close()
        try:
            self.stderr_path.unlink()
        except OSError:
            pass
