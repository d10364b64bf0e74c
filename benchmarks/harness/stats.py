"""Percentiles and summaries of timing samples."""

from __future__ import annotations

import statistics

from mpexec.executor.stats import percentile as _nearest_rank


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in percent (the executor's own definition)."""
    if not values:
        raise ValueError("percentile of no samples")
    return _nearest_rank(sorted(values), q / 100)


def summary(values: list[float]) -> dict[str, float]:
    """n, median, p99, min, max and mean of ``values``."""
    return {"n": len(values), "median": statistics.median(values),
            "p99": percentile(values, 99), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}
