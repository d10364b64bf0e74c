"""``mpexec bench``: run ``benchmarks/bench_<suite>.py`` and print (or plot) their tables.

The scripts live in the source tree, not in an installed wheel; from an
installed copy without them the command says so and exits 2.  Each script
prints tables rendered by ``benchmarks/harness``, which also appends each
table as one JSON line to the file this command names in
``MPEXEC_BENCH_TABLES``.  ``--plot`` draws those tables, one panel per
table: the first column along x, every numeric column as a series (the
leading number of each cell: "12.3 us" -> 12.3).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mpexec.cli import UsageError

SUITES = ("mq", "executor", "collectives", "model", "engine")
_NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def benchmarks_dir() -> Path | None:
    import mpexec

    root = Path(mpexec.__file__).resolve().parents[2]
    candidate = root / "benchmarks"
    return candidate if (candidate / "harness").is_dir() else None


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]


def read_tables(path: Path) -> list[Table]:
    """The tables the scripts appended to ``path`` (one JSON object per line)."""
    if not path.exists():
        return []
    tables = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            tables.append(Table(record["title"], record["headers"], record["rows"]))
    return tables


def plot(tables: list[Table], path: str) -> int:
    """Draw ``tables`` into ``path``; the number of panels drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: .venv/bin/pip install -e '.[plot]'") from None
    panels = []
    for table in tables:
        series = {}
        for col, header in enumerate(table.headers[1:], start=1):
            values = [_number(row[col]) if col < len(row) else None for row in table.rows]
            if values and all(v is not None for v in values):
                series[header] = values
        if series and table.rows:
            panels.append((table, series))
    if not panels:
        return 0
    cols = min(2, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7 * cols, 3.6 * nrows), squeeze=False)
    for ax, (table, series) in zip(axes.flat, panels, strict=False):
        labels = [row[0] for row in table.rows]
        width = 0.8 / len(series)
        for k, (name, values) in enumerate(series.items()):
            ax.bar([x + k * width for x in range(len(labels))], values, width, label=name)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(table.title[:80], fontsize=9)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(panels)


def _number(cell: str) -> float | None:
    match = _NUMBER.match(cell.replace(",", ""))
    return float(match.group()) if match else None


# The layout options of `mpexec bench` and the script options they become.
_SUITE_OPTIONS = {
    "parallel": (("data_parallel_size", "--data-parallel-size"),),
    "context": (("decode_context_parallel_size", "--dcp"),
                ("prefill_context_parallel_size", "--pcp")),
}


def suite_options(suite: str, args: argparse.Namespace) -> list[str]:
    """The script options ``suite`` gets from ``mpexec bench``'s own layout options."""
    extra = []
    for attribute, option in _SUITE_OPTIONS.get(suite, ()):
        value = getattr(args, attribute, None)
        if value is not None:
            extra += [option, str(value)]
    return extra


def run(args: argparse.Namespace, out: TextIO) -> int:
    where = benchmarks_dir()
    if where is None:
        raise UsageError("the benchmark scripts are not here: they live in the source tree "
                         "(benchmarks/); run 'mpexec bench' from a clone installed with "
                         "pip install -e .")
    script_args = [a for a in args.script_args if a != "--"]
    suites = args.suite or [s for s in SUITES if (where / f"bench_{s}.py").exists()]
    missing = [s for s in suites if not (where / f"bench_{s}.py").exists()]
    if missing:
        raise UsageError(f"no benchmark script for suite {missing[0]!r} in {where} "
                         f"(present: {', '.join(p.stem[6:] for p in where.glob('bench_*.py'))})")
    status = 0
    with tempfile.TemporaryDirectory(prefix="mpexec-bench-") as scratch:
        tables_file = Path(scratch) / "tables.jsonl"
        env = {**os.environ, "MPEXEC_BENCH_TABLES": str(tables_file)}
        for suite in suites:
            out.write(f"== mpexec bench --suite {suite}: {where / f'bench_{suite}.py'}\n")
            out.flush()
            proc = subprocess.Popen([sys.executable, str(where / f"bench_{suite}.py"),
                                     *suite_options(suite, args), *script_args],
                                    stdout=subprocess.PIPE, text=True, env=env)
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                out.flush()
            if proc.wait() != 0:
                status = 1
                out.write(f"== suite {suite} exited with status {proc.returncode}\n")
        if args.plot:
            panels = plot(read_tables(tables_file), args.plot)
            out.write(f"== {panels} tables drawn into {args.plot}\n")
    return status
