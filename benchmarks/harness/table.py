"""Plain-text tables for benchmark output."""

from __future__ import annotations

from typing import Any


def render(title: str, headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    """A titled table: the first ``left`` columns left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
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
