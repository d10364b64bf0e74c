"""What every benchmark script shares: statistics and tables.

One percentile definition and one table renderer for the whole project;
scripts import them as ``from harness import percentile, summary, render``
(``benchmarks/`` is on ``sys.path`` when a script under it runs).
"""

from harness.stats import percentile, summary
from harness.table import render, yes_no

__all__ = ["percentile", "render", "summary", "yes_no"]
