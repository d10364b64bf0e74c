"""Run the app under uvicorn until SIGTERM / Ctrl-C or an engine failure.

::

    serve(engine, ...)
      │ uvicorn.Server(app).run()    binds, serves; SIGTERM/SIGINT set should_exit
      │   on shutdown: stop accepting, wait up to `grace_s` for open responses,
      │   then cancel them (a cancelled stream aborts its request)
      │ engine failure: open requests get their 500 / error event, then the same
      │   shutdown begins; serve() raises the engine's error (non-zero exit)
      ▼
    engine.shutdown()                the engine thread ends, the executor shuts down

uvicorn re-raises the signal it caught once it has shut down, to the handler
that was there before it; ``serve`` installs its own for the duration, so a
SIGTERM ends the process with status 0 after a clean shutdown rather than
being killed by its own signal.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any, TextIO

from mpexec.engine.async_llm import AsyncLLM
from mpexec.entrypoints.api_server import MAX_BODY_BYTES, build_app

logger = logging.getLogger(__name__)

FAILURE_DRAIN_S = 0.5  # open requests get their error before the server stops
BACKSTOP_S = 5.0  # uvicorn cancels what is still open this long after the grace period


def serve(engine: AsyncLLM, *, host: str, port: int, model_names: Sequence[str],
          api_key: str | None = None, grace_s: float = 10.0, log_level: str = "warning",
          announce: TextIO | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> int:
    """Serve until told to stop; 0 after a clean stop, the engine's error if it failed."""
    import uvicorn

    app = build_app(engine, model_names, api_key, max_body_bytes)
    # At the end of the grace period the engine aborts what is left, so the
    # streams end (finish_reason "abort") and uvicorn's own deadline, a bit
    # later, is only a backstop.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=math.ceil(grace_s + BACKSTOP_S),
                            lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    failed: list[BaseException] = []

    def on_failure(exc: BaseException) -> None:  # on the engine thread
        failed.append(exc)
        loop = getattr(server, "_mpexec_loop", None)
        if loop is not None:
            try:
                loop.call_soon_threadsafe(loop.call_later, FAILURE_DRAIN_S, _stop, server)
            except RuntimeError:
                pass

    async def main() -> None:
        server._mpexec_loop = asyncio.get_running_loop()  # type: ignore[attr-defined]
        if engine.error is not None or not engine.is_healthy:
            on_failure(engine.error or RuntimeError("the engine failed"))
        if stop_signals:  # told to stop before uvicorn took over the signals
            return
        await server.serve()

    engine.on_failure = on_failure
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop_signals: list[int] = []

    def remember(sig: int, frame: FrameType | None) -> None:
        stop_signals.append(sig)

    for sig in previous:
        signal.signal(sig, remember)
    out = announce or sys.stderr
    started = _Announcer(server, out, host, port, model_names)
    try:
        asyncio.run(_with(main(), started.run(), _abort_after_grace(server, engine, grace_s)))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.shutdown()
    if failed:
        raise failed[0]
    return 0


def _stop(server: Any) -> None:
    server.should_exit = True


class _Announcer:
    """One line on stderr once the socket is bound (tests and users wait for it)."""

    def __init__(self, server: Any, out: TextIO, host: str, port: int,
                 names: Sequence[str]) -> None:
        self.server, self.out, self.host, self.port, self.names = server, out, host, port, names

    async def run(self) -> None:
        while not self.server.started:
            if self.server.should_exit:
                return
            await asyncio.sleep(0.05)
        self.out.write(f"mpexec serve: {', '.join(self.names)} on "
                       f"http://{self.host}:{self.port} (Ctrl-C stops)\n")
        self.out.flush()


async def _abort_after_grace(server: Any, engine: AsyncLLM, grace_s: float) -> None:
    while not server.should_exit:
        await asyncio.sleep(0.1)
    await asyncio.sleep(grace_s)
    engine.abort_all()


async def _with(main: Any, *side: Any) -> None:
    tasks = [asyncio.ensure_future(s) for s in side]
    try:
        await main
    finally:
        for task in tasks:
            task.cancel()
