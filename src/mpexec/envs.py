"""Every ``MPEXEC_*`` environment variable, in one place.

The environment is read once, by :func:`load_envs`, into a frozen
:class:`Envs`; code below this module never touches ``os.environ`` for
settings.  Configuration objects take their defaults from an ``Envs`` only
when asked (``ExecutorConfig.from_env``), so a program that builds its config
explicitly is not affected by the environment it happens to run in.

=======================================  =========  ==========================
variable                                 default    meaning
=======================================  =========  ==========================
MPEXEC_EXECUTE_MODEL_TIMEOUT_SECONDS     300        deadline of execute_model
                                                    and sample_tokens (``none``
                                                    or ``0``: no deadline)
MPEXEC_STARTUP_TIMEOUT_SECONDS           300        workers must be READY
                                                    within this
MPEXEC_SHUTDOWN_GRACE_SECONDS            4          wait before SIGTERM (and
                                                    again before SIGKILL)
MPEXEC_WORKER_MULTIPROC_METHOD           fork       fork, spawn or forkserver
MPEXEC_MQ_MAX_CHUNK_BYTES                524288     bytes per ring chunk
MPEXEC_MQ_MAX_CHUNKS                     8          chunks per ring
MPEXEC_MQ_SPIN_SECONDS                   0.001      how long a queue waiter
                                                    polls before it sleeps on
                                                    a futex (0: sleep at once)
MPEXEC_LOGGING_LEVEL                     INFO       level of mpexec's loggers
MPEXEC_TRACE                             0          OpenTelemetry spans around
                                                    start-up and calls (when
                                                    opentelemetry is installed)
MPEXEC_CLUSTER_SECRET                    (none)     the secret that authenticates
                                                    every frame between nodes
MPEXEC_RAY_ADDRESS                       (unset)    the Ray cluster the "ray"
                                                    backend joins (unset:
                                                    RAY_ADDRESS if set, else
                                                    a local Ray of its own)
MPEXEC_NODE_ID                           (unset)    this process's node, as
                                                    process groups see it
                                                    (unset: host name and
                                                    boot id); different
                                                    values make processes
                                                    of one host use the
                                                    cross-node path (gloo)
MPEXEC_CLUSTER_CURVE                     0          encrypt the sockets between
                                                    nodes (ZeroMQ CURVE, keys
                                                    from the cluster secret)
MPEXEC_API_KEY                           (none)     the key ``mpexec serve``
                                                    asks of every request
                                                    (when no --api-key)
MPEXEC_MAX_CPU_WORKERS                   (unset)    CPU workers one node may
                                                    start (unset: 4 per usable
                                                    CPU, at least 16)
=======================================  =========  ==========================

Two more are read where they are used, not here: ``MPEXEC_CACHE_DIR`` (default
``~/.cache/mpexec``), where models are fetched to, by
``mpexec.models.fetch.default_cache_dir`` - it must hold in processes that
never build an :class:`Envs`.  And ``MPEXEC_BENCH_TABLES`` is set by
``mpexec bench`` for the benchmark scripts it runs (their harness, outside
the package, appends each table there as JSON); users never set it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Envs:
    """The parsed ``MPEXEC_*`` variables (see the module docstring)."""

    execute_model_timeout_s: float | None = 300.0
    startup_timeout_s: float = 300.0
    shutdown_grace_s: float = 4.0
    worker_multiproc_method: str = "fork"
    mq_max_chunk_bytes: int = 512 * 1024
    mq_max_chunks: int = 8
    mq_spin_s: float = 0.001
    logging_level: str = "INFO"
    trace: bool = False
    cluster_secret: str | None = field(default=None, repr=False)
    ray_address: str | None = None
    node_id: str | None = None
    cluster_curve: bool = False
    api_key: str | None = field(default=None, repr=False)
    max_cpu_workers: int | None = None


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")


def _parse_optional_seconds(text: str) -> float | None:
    if text.strip().lower() in {"none", "0", ""}:
        return None
    return _parse_seconds(text)


def _parse_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("must be a finite number of seconds")
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def _parse_spin_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or not 0 <= value <= 1:
        raise ValueError("must be in [0, 1] seconds")
    return value


def _parse_level(text: str) -> str:
    level = text.strip().upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise ValueError("expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def _parse_method(text: str) -> str:
    method = text.strip().lower()
    if method not in {"fork", "spawn", "forkserver"}:
        raise ValueError("expected fork, spawn or forkserver")
    return method


def _parse_address(text: str) -> str | None:
    return text.strip() or None


def _parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _read(environ: Mapping[str, str], name: str, parse: Callable[[str], T], default: T) -> T:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not valid: {exc}") from None


def load_envs(environ: Mapping[str, str] | None = None) -> Envs:
    """Parse the ``MPEXEC_*`` variables of ``environ`` (``os.environ`` by default).

    A malformed value raises ``ValueError`` naming the variable.
    """
    env = os.environ if environ is None else environ
    d = Envs()
    return Envs(
        execute_model_timeout_s=_read(
            env, "MPEXEC_EXECUTE_MODEL_TIMEOUT_SECONDS", _parse_optional_seconds,
            d.execute_model_timeout_s,
        ),
        startup_timeout_s=_read(
            env, "MPEXEC_STARTUP_TIMEOUT_SECONDS", _parse_seconds, d.startup_timeout_s
        ),
        shutdown_grace_s=_read(
            env, "MPEXEC_SHUTDOWN_GRACE_SECONDS", _parse_seconds, d.shutdown_grace_s
        ),
        worker_multiproc_method=_read(
            env, "MPEXEC_WORKER_MULTIPROC_METHOD", _parse_method, d.worker_multiproc_method
        ),
        mq_max_chunk_bytes=_read(
            env, "MPEXEC_MQ_MAX_CHUNK_BYTES", _parse_positive_int, d.mq_max_chunk_bytes
        ),
        mq_max_chunks=_read(env, "MPEXEC_MQ_MAX_CHUNKS", _parse_positive_int, d.mq_max_chunks),
        mq_spin_s=_read(env, "MPEXEC_MQ_SPIN_SECONDS", _parse_spin_seconds, d.mq_spin_s),
        logging_level=_read(env, "MPEXEC_LOGGING_LEVEL", _parse_level, d.logging_level),
        trace=_read(env, "MPEXEC_TRACE", _parse_bool, d.trace),
        cluster_secret=env.get("MPEXEC_CLUSTER_SECRET") or None,
        ray_address=_read(env, "MPEXEC_RAY_ADDRESS", _parse_address, d.ray_address),
        node_id=_read(env, "MPEXEC_NODE_ID", _parse_address, d.node_id),
        cluster_curve=_read(env, "MPEXEC_CLUSTER_CURVE", _parse_bool, d.cluster_curve),
        api_key=env.get("MPEXEC_API_KEY") or None,
        max_cpu_workers=_read(env, "MPEXEC_MAX_CPU_WORKERS", _parse_positive_int,
                              d.max_cpu_workers),
    )
