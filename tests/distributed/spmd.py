"""The SPMD rank runner of the distributed tests: ``benchmarks/harness/spmd.py``.

The collectives benchmark runs its ranks the same way, so the one runner lives
in the benchmark harness; this module puts ``benchmarks/`` on ``sys.path``
(where spawned children inherit it) and re-exports ``run_ranks`` and
``RankFailed``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from harness.spmd import RankFailed, run_ranks  # noqa: E402

__all__ = ["RankFailed", "run_ranks"]
