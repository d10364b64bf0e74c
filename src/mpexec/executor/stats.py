"""Per-method call counts and latency percentiles (``Executor.stats()``).

The executor records one sample per resolved call.  Each method keeps a
bounded reservoir (Vitter's algorithm R), so memory stays fixed however long
the executor runs while the percentiles remain an unbiased sample of every
call made.  Recording takes a lock so that replies resolved by different
caller threads are counted once each.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

RESERVOIR_SIZE = 1024


@dataclass(frozen=True)
class MethodStats:
    """A snapshot for one method; latencies in seconds."""

    calls: int
    failures: int
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float


class _Reservoir:
    __slots__ = ("calls", "failures", "samples", "max_s")

    def __init__(self) -> None:
        self.calls = 0
        self.failures = 0
        self.samples: list[float] = []
        self.max_s = 0.0


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted samples: the smallest sample with at
    least ``q`` (0..1) of them at or below it; 0.0 for no samples."""
    if not ordered:
        return 0.0
    index = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


class CallStats:
    """Collects latencies of calls by method name."""

    def __init__(self, reservoir_size: int = RESERVOIR_SIZE, seed: int = 0) -> None:
        self.reservoir_size = reservoir_size
        self._methods: dict[str, _Reservoir] = {}
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def record(self, method: str, latency_s: float, ok: bool = True) -> None:
        with self._lock:
            entry = self._methods.get(method)
            if entry is None:
                entry = self._methods[method] = _Reservoir()
            entry.calls += 1
            if not ok:
                entry.failures += 1
            if latency_s > entry.max_s:
                entry.max_s = latency_s
            samples = entry.samples
            if len(samples) < self.reservoir_size:
                samples.append(latency_s)
            else:
                # random() is one C call; randrange() costs a microsecond
                slot = int(self._random.random() * entry.calls)
                if slot < self.reservoir_size:
                    samples[slot] = latency_s

    def snapshot(self) -> dict[str, MethodStats]:
        with self._lock:
            items = [(name, e.calls, e.failures, sorted(e.samples), e.max_s)
                     for name, e in self._methods.items()]
        return {
            name: MethodStats(
                calls=calls,
                failures=failures,
                p50_s=percentile(ordered, 0.50),
                p90_s=percentile(ordered, 0.90),
                p99_s=percentile(ordered, 0.99),
                max_s=max_s,
            )
            for name, calls, failures, ordered, max_s in items
        }
