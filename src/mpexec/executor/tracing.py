"""Optional OpenTelemetry spans around worker start-up and calls, one trace
across the driver and its workers.

Tracing is a setting of one executor (``ExecutorConfig.trace``, from
``MPEXEC_TRACE``), never a switch of the process: each traced executor
holds its own :class:`Tracer`, and so does each of its workers (started
from the same configuration, which travels in their spec), so an untraced
executor created later records nothing.  Without ``opentelemetry`` a tracer
is the no-op :data:`NO_TRACER`.

Where spans go::

    trace_exporter None     the process's own OpenTelemetry setup (the
                            global TracerProvider the application
                            configured; a worker process usually has none)
    trace_exporter "m:f"    each process of the executor (driver and every
                            worker) builds a TracerProvider of its own around
                            the SpanExporter that ``m.f()`` returns (a
                            synchronous span processor: no thread is
                            started, nothing is lost when a worker exits)

How one trace spans the processes: the driver's ``executor.collective_rpc``
span is the parent of every worker's ``worker.call`` span for that call,
and ``executor.start`` the parent of each ``worker.start``.  The parent
travels as a W3C ``traceparent`` (:meth:`Tracer.carrier`): in the call
message as a sixth element, only when tracing is on (an untraced call is
the usual 5-tuple, unchanged), and in the worker's spec for start-up.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

logger = logging.getLogger(__name__)

Carrier = dict[str, str]


class Tracer:
    """Creates spans for one executor (or one worker); no-op without a backend."""

    def __init__(self, backend: Any = None, propagator: Any = None,
                 provider: Any = None) -> None:
        self._backend = backend
        self._propagator = propagator
        self._provider = provider  # a TracerProvider of our own, shut down with us

    @classmethod
    def create(cls, enabled: bool, process_name: str, exporter: str | None = None) -> Tracer:
        """A recording tracer when ``enabled`` and opentelemetry is installed.

        ``exporter``: ``"module:factory"`` of a SpanExporter for a provider
        of this tracer's own (see the module docstring); None: the global one.
        """
        if not enabled:
            return NO_TRACER
        try:
            from opentelemetry import trace  # optional dependency
        except ImportError:
            logger.debug("tracing is on but opentelemetry is not installed; no spans")
            return NO_TRACER
        try:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
            propagator: Any = TraceContextTextMapPropagator()
        except ImportError:  # an API without propagation: spans, but not linked
            propagator = None
        name = f"mpexec.{process_name}"
        if exporter is None:
            return cls(trace.get_tracer(name), propagator)
        provider = _own_provider(exporter, process_name)
        return cls(provider.get_tracer(name), propagator, provider)

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    def carrier(self) -> Carrier | None:
        """The current span as a W3C ``traceparent`` (None: nothing to pass on)."""
        if self._propagator is None:
            return None
        carrier: Carrier = {}
        self._propagator.inject(carrier)
        return carrier or None

    @contextlib.contextmanager
    def span(self, name: str, parent: Mapping[str, str] | None = None,
             **attributes: Any) -> Iterator[None]:
        """A span named ``name`` when recording, else nothing.

        ``parent``: a carrier from another process (:meth:`carrier`); the
        span is then that span's child, in the same trace.
        """
        backend = self._backend
        if backend is None:
            yield
            return
        if parent and self._propagator is not None:
            context = self._propagator.extract(dict(parent))
            with backend.start_as_current_span(name, context=context, attributes=attributes):
                yield
            return
        with backend.start_as_current_span(name, attributes=attributes):
            yield

    def shutdown(self) -> None:
        """Flush and close a provider of our own (the global one is not ours)."""
        provider, self._provider = self._provider, None
        if provider is not None:
            try:
                provider.shutdown()
            except Exception:
                logger.debug("shutting the tracer provider down failed", exc_info=True)


def current_carrier() -> Carrier | None:
    """The calling thread's current span as a W3C ``traceparent``, if any.

    For code that holds no :class:`Tracer` (the worker specs are built
    inside the driver's ``executor.start`` span); reads the context of this
    thread only.
    """
    try:
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )
    except ImportError:
        return None
    carrier: Carrier = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier or None


def _own_provider(exporter: str, process_name: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    module, _, attr = exporter.partition(":")
    factory: Any = importlib.import_module(module)
    for part in attr.split("."):
        factory = getattr(factory, part)
    provider = TracerProvider(resource=Resource.create({"service.name": "mpexec",
                                                       "mpexec.process": process_name}))
    provider.add_span_processor(SimpleSpanProcessor(factory()))
    return provider


NO_TRACER = Tracer()
