"""The server's ends: an API key, SIGTERM under load, a worker killed mid-stream.

Each test starts its own ``python -m mpexec serve`` on the tiny checkpoint and
proves, with ``leak_check``, that nothing of it is left afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.server_proc import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.usefixtures("leak_check")]

LONG = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 400,
        "temperature": 0, "ignore_eos": True, "stream": True}


class Streamer(threading.Thread):
    """One streaming request read in a thread: its SSE data lines, and how it ended."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers
        self.events: list[str] = []
        self.status: int | None = None
        self.failure: BaseException | None = None
        self.first = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120) as http, http.stream(
                    "POST", f"{self.url}/v1/completions", json=self.body,
                    headers=self.headers) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except BaseException as exc:  # the connection closing is an answer too
            self.failure = exc
        finally:
            self.first.set()

    def finish_reasons(self) -> list[str]:
        reasons = []
        for event in self.events:
            if event != "[DONE]":
                reason = json.loads(event).get("choices", [{}])[0].get("finish_reason")
                if reason:
                    reasons.append(reason)
        return reasons


def test_api_key_then_sigterm_under_load(tiny_checkpoint: Path) -> None:
    with ServerProcess(str(tiny_checkpoint), "--served-model-name", "tiny",
                       "--shutdown-grace", "1", env={"MPEXEC_API_KEY": "sesame"}) as server:
        server.wait_ready()
        refused = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            refused.models.list()
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200  # open to probes
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices

        auth = {"Authorization": "Bearer sesame"}
        streams = [Streamer(server.url, LONG, auth) for _ in range(6)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.first.wait(120)
        assert server.stop(signal.SIGTERM) == 0, server.log()
        for stream in streams:
            stream.join(30)
            assert not stream.is_alive()
            # each stream ended cleanly: cut short by the grace period, or done
            assert stream.status == 200 and stream.events[-1] == "[DONE]", stream.events[-3:]
            assert stream.finish_reasons() in (["abort"], ["length"])
        assert "Traceback" not in server.log()


def _worker_pids(server: ServerProcess) -> list[int]:
    pids = []
    for pid in server.worker_pids():
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"Worker" in name:
            pids.append(pid)
    return pids


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 needs 2 CPUs")
def test_a_worker_killed_mid_stream(tiny_checkpoint: Path) -> None:
    with ServerProcess(str(tiny_checkpoint), "--served-model-name", "tiny", "-tp", "2",
                       "--shutdown-grace", "2") as server:
        server.wait_ready()
        streams = [Streamer(server.url, LONG, {}) for _ in range(3)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.first.wait(120)
        plain: dict[str, Any] = {}

        def non_stream() -> None:
            body = {**LONG, "stream": False}
            try:
                plain["response"] = httpx.post(f"{server.url}/v1/completions", json=body,
                                               timeout=120)
            except httpx.HTTPError as exc:
                plain["error"] = exc

        waiter = threading.Thread(target=non_stream, daemon=True)
        waiter.start()
        time.sleep(0.5)
        workers = _worker_pids(server)
        assert len(workers) == 2, server.log()
        os.kill(workers[1], signal.SIGKILL)
        health = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and health is None:
            try:
                code = httpx.get(f"{server.url}/health", timeout=5).status_code
            except httpx.HTTPError:
                break
            if code == 503:
                health = code
            time.sleep(0.05)
        code = server.proc.wait(60)
        assert code != 0
        assert health == 503
        for stream in streams:
            stream.join(30)
            errors = [json.loads(e)["error"] for e in stream.events
                      if e != "[DONE]" and "error" in json.loads(e)]
            assert errors and "the engine failed: WorkerDiedError" in errors[0]["message"]
            assert errors[0]["code"] == 500
        waiter.join(30)
        response = plain.get("response")
        assert response is not None and response.status_code == 500, plain
        assert "WorkerDiedError" in response.json()["error"]["message"]
        log = server.log()
        assert "a worker died" in log.splitlines()[-1], log
