"""Plain-text tables for benchmark output, and the same tables as JSON lines.

``mpexec bench`` names a file in ``MPEXEC_BENCH_TABLES`` for the scripts it
runs: every table rendered is also appended to it as one JSON object
(``{"title", "headers", "rows"}``, cells as printed), which is what
``--plot`` draws, so nothing is parsed back out of the printed text.
"""

from __future__ import annotations

import json
import os
from typing import Any

# Read once: the file mpexec bench collects the tables in (unset: print only).
TABLES_FILE = os.environ.get("MPEXEC_BENCH_TABLES") or None


def render(title: str, headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    """A titled table: the first ``left`` columns left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    if TABLES_FILE is not None:
        with open(TABLES_FILE, "a", encoding="utf-8") as sink:
            sink.write(json.dumps({"title": title, "headers": [str(h) for h in headers],
                                   "rows": cells}) + "\n")
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]

    def line(row: list[str]) -> str:
        parts = [c.ljust(w) if i < left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(parts).rstrip()

    out = [title, line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def yes_no(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")
