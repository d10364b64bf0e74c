"""What every benchmark script shares: statistics, tables, child fleets,
CPU placement, machine facts and leftover checks.

One percentile definition and one table renderer for the whole project;
scripts import them as ``from harness import percentile, summary, render``
(``benchmarks/`` is on ``sys.path`` when a script under it runs).
"""

from harness.fleet import BenchError, Fleet
from harness.leftovers import children_left, dev_shm, own_memfds
from harness.machine import cpu_s_of, descendant_pids, free_ports, machine_info, proc_cpu_s
from harness.placement import PLACEMENTS, pin, place
from harness.stats import percentile, summary
from harness.table import render, yes_no

__all__ = [
    "PLACEMENTS",
    "BenchError",
    "Fleet",
    "children_left",
    "cpu_s_of",
    "descendant_pids",
    "dev_shm",
    "free_ports",
    "machine_info",
    "own_memfds",
    "percentile",
    "pin",
    "place",
    "proc_cpu_s",
    "render",
    "summary",
    "yes_no",
]
