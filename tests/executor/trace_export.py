"""A SpanExporter for the tracing tests: every process of an executor (driver
and workers) appends its finished spans, one JSON line each, to the file
named by ``MPEXEC_TEST_TRACE_FILE``.  ``ExecutorConfig(trace_exporter=
"tests.executor.trace_export:file_exporter")`` makes each process build its
own provider around one of these."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

ENV = "MPEXEC_TEST_TRACE_FILE"


class FileSpanExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            context = span.get_span_context()
            assert context is not None
            lines.append(json.dumps({
                "name": span.name,
                "trace_id": f"{context.trace_id:032x}",
                "span_id": f"{context.span_id:016x}",
                "parent_id": None if span.parent is None else f"{span.parent.span_id:016x}",
                "process": span.resource.attributes.get("mpexec.process"),
                "pid": os.getpid(),
                "attributes": dict(span.attributes or {}),
            }) + "\n")
        # One write per batch, O_APPEND: lines of several processes never mix.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, "".join(lines).encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def file_exporter() -> FileSpanExporter:
    return FileSpanExporter(os.environ[ENV])


def read_spans(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
