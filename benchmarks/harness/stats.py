"""Percentiles and summaries of timing samples."""

from __future__ import annotations

import math
import statistics


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q% at or below it."""
    if not values:
        raise ValueError("percentile of no samples")
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    """n, median, p99, min, max and mean of ``values``."""
    return {"n": len(values), "median": statistics.median(values),
            "p99": percentile(values, 99), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}
