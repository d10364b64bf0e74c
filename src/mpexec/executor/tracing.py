"""Optional OpenTelemetry spans around worker start-up and calls.

Tracing is a setting of one executor (``ExecutorConfig.trace``, from
``MPEXEC_TRACE``), never a switch of the process: each traced executor
holds its own :class:`Tracer` and passes ``trace`` to its workers in their
spec, so an untraced executor created later records nothing.  A tracer
records spans only when ``opentelemetry`` can be imported; otherwise it is
the no-op :data:`NO_TRACER`.  The process that wants spans exported
configures an OpenTelemetry SDK itself; this module only creates spans.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)


class Tracer:
    """Creates spans for one executor (or one worker); no-op without a backend."""

    def __init__(self, backend: Any = None) -> None:
        self._backend = backend

    @classmethod
    def create(cls, enabled: bool, process_name: str) -> Tracer:
        """A recording tracer when ``enabled`` and opentelemetry is installed."""
        if not enabled:
            return NO_TRACER
        try:
            from opentelemetry import trace  # optional dependency
        except ImportError:
            logger.debug("tracing is on but opentelemetry is not installed; no spans")
            return NO_TRACER
        return cls(trace.get_tracer(f"mpexec.{process_name}"))

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[None]:
        """A span named ``name`` when recording, else nothing."""
        backend = self._backend
        if backend is None:
            yield
            return
        with backend.start_as_current_span(name, attributes=attributes):
            yield


NO_TRACER = Tracer()
