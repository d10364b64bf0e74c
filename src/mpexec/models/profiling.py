"""Where a worker's time goes: ``LLM.start_profile()`` / ``LLM.stop_profile()``.

Model code marks its phases with :func:`span`::

    with span("dcp.merge"):
        ...

While no profile runs (always, unless someone called ``start_profile``) a
span is one global read and a ``nullcontext``: nothing is timed or recorded.
While one runs, each span adds its wall time and a call to a per-name total
in this process, and shows as a ``record_function`` range in the torch
profiler's trace when one was asked for.

``start_profile(trace_dir)`` on the model worker starts collecting;
``stop_profile()`` stops and returns a :class:`ProfileSummary` per rank:
the span totals, the wall time of the profile window, and, when a trace
directory was given, the path of this rank's Chrome trace
(``<trace_dir>/rank<N>.json``, openable in ``chrome://tracing`` or Perfetto).
The spans are timed with ``perf_counter``, so their totals are the same
with or without the trace; the trace itself slows every operator down.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class SpanTotal:
    calls: int = 0
    seconds: float = 0.0


@dataclass
class ProfileSummary:
    """One rank's profile window."""

    rank: int
    wall_s: float
    spans: dict[str, SpanTotal] = field(default_factory=dict)
    trace_path: str | None = None

    def share(self, prefix: str) -> float:
        """The fraction of the window spent in spans whose name starts with ``prefix``."""
        spent = sum(t.seconds for name, t in self.spans.items() if name.startswith(prefix))
        return spent / self.wall_s if self.wall_s > 0 else 0.0


class _Profile:
    def __init__(self, trace_dir: str | None) -> None:
        self.spans: dict[str, SpanTotal] = {}
        self.trace_dir = trace_dir
        self.torch_profiler: Any = None
        if trace_dir is not None:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            self.torch_profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU])
            self.torch_profiler.__enter__()
        self.started = time.perf_counter()


_active: _Profile | None = None


@contextlib.contextmanager
def _timed(name: str, profile: _Profile) -> Iterator[None]:
    start = time.perf_counter()
    record = (torch.profiler.record_function(name) if profile.torch_profiler is not None
              else contextlib.nullcontext())
    with record:
        try:
            yield
        finally:
            total = profile.spans.setdefault(name, SpanTotal())
            total.calls += 1
            total.seconds += time.perf_counter() - start


def span(name: str) -> contextlib.AbstractContextManager[None]:
    """A named phase of the model's work (see the module docstring)."""
    profile = _active
    if profile is None:
        return contextlib.nullcontext()
    return _timed(name, profile)


def start(trace_dir: str | None = None) -> None:
    """Start collecting in this process; a profile already running is an error."""
    global _active
    if _active is not None:
        raise RuntimeError("a profile is already running: call stop_profile() first")
    _active = _Profile(trace_dir)


def stop(rank: int) -> ProfileSummary:
    """Stop collecting; the totals since :func:`start` (an error if none ran)."""
    global _active
    profile = _active
    if profile is None:
        raise RuntimeError("no profile is running: call start_profile() first")
    _active = None
    wall = time.perf_counter() - profile.started
    trace_path = None
    if profile.torch_profiler is not None:
        profile.torch_profiler.__exit__(None, None, None)
        assert profile.trace_dir is not None
        trace_path = str(Path(profile.trace_dir) / f"rank{rank}.json")
        profile.torch_profiler.export_chrome_trace(trace_path)
    return ProfileSummary(rank, wall, profile.spans, trace_path)
