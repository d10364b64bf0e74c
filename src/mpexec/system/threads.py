"""The thread-count environment a worker starts with (never the driver's)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

logger = logging.getLogger(__name__)

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def thread_vars(num_threads: int | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The thread variables to add to ``environ`` for a worker.

    ``None`` means an accelerator worker (one thread: the device does the
    work); an integer is a CPU worker's own share of the cores.  Variables the
    user set are never overridden: ``OMP_NUM_THREADS`` in the environment
    means the user is tuning, and nothing is added.
    """
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1; got {num_threads}")
    if "OMP_NUM_THREADS" in environ:
        return {}
    value = str(1 if num_threads is None else num_threads)
    return {var: value for var in THREAD_ENV_VARS if var not in environ}


@contextlib.contextmanager
def worker_thread_env(num_threads: int | None) -> Iterator[dict[str, str]]:
    """Hold one worker's thread-count variables in ``os.environ`` for a start.

    A started process copies the environment at start time (a spawned one
    reads it before any of its imports), so wrapping one ``Process.start()``
    gives that worker its own count while the driver's environment is
    restored afterwards: the driver never keeps the setting, and its torch
    thread pool is never touched.  Hold it only around a start, from the
    thread that starts the workers.  Yields the variables it set (empty when
    the user set ``OMP_NUM_THREADS``).
    """
    updates = thread_vars(num_threads, os.environ)
    os.environ.update(updates)
    try:
        yield updates
    finally:
        for var in updates:
            os.environ.pop(var, None)


def apply_thread_env_in_child(updates: Mapping[str, str]) -> None:
    """In a freshly started worker: make an already imported torch follow ``updates``.

    A forked worker inherits the driver's torch thread pool; the environment
    it was started with only reaches libraries imported after the fork.
    """
    import sys

    threads = updates.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if threads is None or torch is None:
        return
    try:
        torch.set_num_threads(int(threads))
    except Exception as exc:  # a stubbed or half-imported torch
        logger.debug("Could not set torch threads in the worker: %s", exc)
