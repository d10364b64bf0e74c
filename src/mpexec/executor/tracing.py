"""Optional OpenTelemetry spans around worker start-up and calls.

``span(name, **attributes)`` is a context manager.  It records a span only
when tracing was switched on (``ExecutorConfig.trace``, from ``MPEXEC_TRACE``)
with :func:`enable` *and* ``opentelemetry`` can be imported; otherwise it
costs one attribute check.  The process that wants spans exported configures
an OpenTelemetry SDK itself; this module only creates spans.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_tracer: Any = None


def enable(process_name: str) -> bool:
    """Start recording spans in this process; False when opentelemetry is missing."""
    global _tracer
    try:
        from opentelemetry import trace  # optional dependency
    except ImportError:
        logger.debug("MPEXEC_TRACE is set but opentelemetry is not installed; no spans")
        return False
    _tracer = trace.get_tracer(f"mpexec.{process_name}")
    return True


def disable() -> None:
    global _tracer
    _tracer = None


def is_enabled() -> bool:
    return _tracer is not None


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A span named ``name`` while tracing is enabled, else nothing."""
    tracer = _tracer
    if tracer is None:
        yield
        return
    with tracer.start_as_current_span(name, attributes=attributes):
        yield
