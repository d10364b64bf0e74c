"""Choosing how workers start: the start method, and when fork is unsafe."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import os
import sys
import threading

logger = logging.getLogger(__name__)

START_METHODS = ("spawn", "fork", "forkserver")


def get_mp_context(method: str | None = None) -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context for ``method`` (``"spawn"`` when None).

    Raises ``ValueError`` for a name other than spawn, fork or forkserver, and
    for a method this platform does not offer.
    """
    method = method or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"start method must be one of {', '.join(START_METHODS)}; got {method!r}")
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start method {method!r} is not available on this platform")
    return multiprocessing.get_context(method)


def maybe_force_spawn(method: str) -> str:
    """Return ``"spawn"`` where ``"fork"`` would be unsafe, else ``method``.

    Forking is unsafe once this process has initialised CUDA (the child
    inherits a CUDA context it cannot use) or runs more than one thread (a
    lock held by another thread at fork time stays locked in the child
    forever).  The reason is logged at WARNING.
    """
    if method != "fork":
        return method
    reason = _fork_hazard()
    if reason is None:
        return method
    logger.warning("Using start method 'spawn' instead of 'fork': %s.", reason)
    return "spawn"


def _fork_hazard() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            cuda_ready = bool(torch.cuda.is_initialized())
        except Exception:  # a half-imported or stubbed torch: no CUDA to worry about
            cuda_ready = False
        if cuda_ready:
            return "CUDA is already initialised in this process"
    threads = running_thread_count()
    if threads > 1:
        names = ", ".join(t.name for t in threading.enumerate())
        return f"{threads} threads are running (Python threads: {names})"
    return None


def running_thread_count() -> int:
    """Threads of this process, native ones included where the OS tells."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
