#!/usr/bin/env python3
"""Benchmark of ``mpexec.ipc.MessageQueue``, the shared-memory transport.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_mq.py [--quick] [--iters N]
        [--readers 1,2,4] [--placements free,apart,together] [--json PATH]

Figures, each compared with baselines measured in the same run:

1. round trip of a ~100-byte call message: the driver broadcasts it, each of
   N reader processes replies on its own path, the driver collects N replies.
   MessageQueue against ``multiprocessing.Pipe``, ZeroMQ over ``ipc://`` and
   the *floor*: the least a shared-memory ring can do in pure Python (one
   slot, one write counter, one read counter per reader, spin with
   ``sched_yield``), in ``mqbench/floor.py``.  On a small machine where the
   processes run matters as much as the transport (a reader spinning on the
   driver's CPU costs a context switch per hop), so each round trip is
   measured unpinned and with two pinnings (``--placements``);
2. broadcast of a 64 MiB numpy array and of 64 MiB of ``bytes`` to N readers,
   against one warm 64 MiB memcpy (and a page-touching read of the array);
3. CPU used by a reader blocked in ``dequeue()``, and by one receiving
   20 messages/s, against a reader blocked on a Pipe;
4. wake-up latency of a reader that has gone to sleep (and what the spinning
   floor pays to avoid sleeping);
5. shared memory taken by the default queue sizes;
6. (``--sections path``) the queue's own code path in one process, the
   figure to compare two versions with on a loaded machine.

Readers are separate processes started with the ``spawn`` method.  Every wait
is bounded, children are reaped and every queue is shut down on every path.
Exit status: 0 when every measurement ran and every reply checked out
(missed targets are reported, they are not failures); 1 otherwise.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_SRC = Path(__file__).resolve().parent.parent / "src"
if (_SRC / "mpexec").is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

from harness import (  # noqa: E402
    PLACEMENTS,
    children_left,
    dev_shm,
    machine_info,
    own_memfds,
    render,
    yes_no,
)
from mqbench.fig_bcast import figure_bcast  # noqa: E402
from mqbench.fig_cpu import figure_cpu_wake  # noqa: E402
from mqbench.fig_path import figure_path  # noqa: E402
from mqbench.fig_rtt import figure_rtt  # noqa: E402
from mqbench.fig_shm import figure_shm  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run for smoke tests (< 30 s)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed round trips per transport and N (default 6000; quick 300)")
    p.add_argument("--readers", default="1,2,4", help="reader counts for the round trips")
    p.add_argument("--placements", default="free,apart,together",
                   help="CPU placements for the round trips: " + "; ".join(
                       f"{k}: {v}" for k, v in PLACEMENTS.items()))
    p.add_argument("--passes", type=int, default=None,
                   help="round-trip passes per transport, order alternating (default 2; quick 1)")
    p.add_argument("--bcast-readers", default="1,2", help="reader counts for 64 MiB broadcasts")
    p.add_argument("--sections", default="rtt,bcast,cpu,shm",
                   help="comma list of: rtt, bcast, cpu (cpu + wake-up), shm, path (the "
                        "queue's code path in one process; not in the default set)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--max-seconds", type=float, default=900.0,
                   help="abort (dumping stacks) if the whole run exceeds this")
    args = p.parse_args(argv)
    try:
        args.readers = [int(x) for x in args.readers.split(",") if x.strip()]
        args.bcast_readers = [int(x) for x in args.bcast_readers.split(",") if x.strip()]
    except ValueError:
        p.error("--readers / --bcast-readers take comma-separated integers")
    if not args.readers or min(args.readers) < 1 or min(args.bcast_readers or [1]) < 1:
        p.error("reader counts must be >= 1")
    args.placements = [x.strip() for x in args.placements.split(",") if x.strip()]
    if not args.placements or set(args.placements) - set(PLACEMENTS):
        p.error(f"--placements: choose from {', '.join(PLACEMENTS)}")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = args.sections - {"rtt", "bcast", "cpu", "shm", "path"}
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    if args.iters is None:
        args.iters = 300 if args.quick else 6000
    if args.iters < 1:
        p.error("--iters must be >= 1")
    if args.passes is None:
        args.passes = 1 if args.quick else 2
    if args.passes < 1:
        p.error("--passes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)
    quick = args.quick
    warmup = 50 if quick else 500
    runs, bcast_warmups = (3, 1) if quick else (7, 2)
    idle_s = rate_s = 1.0 if quick else 5.0
    wake_samples = 20 if quick else 100

    ctx = multiprocessing.get_context("spawn")
    shm_before = dev_shm()
    started = time.monotonic()
    info = machine_info()
    results: dict[str, Any] = {"machine": info, "quick": quick}
    print(f"bench_mq: nproc={info['nproc']} (affinity {info['affinity']}), "
          f"python {info['python']}, {info['machine']}, kernel {info['kernel']}, "
          f"cpu {info['cpu']!r}, load {info['loadavg_at_start']}")
    print(f"          mpexec fence {info.get('mpexec_fence')}, numpy {info.get('numpy')}, "
          f"pyzmq {info.get('pyzmq')}; readers are spawned processes; "
          f"{'QUICK run' if quick else 'full run'}; medians and p99 (nearest rank)")
    print(flush=True)
    status = 0
    try:
        if "rtt" in args.sections:
            figure_rtt(ctx, args.readers, args.iters, warmup, args.passes, args.placements,
                       results)
        if "bcast" in args.sections and args.bcast_readers:
            figure_bcast(ctx, args.bcast_readers, runs, bcast_warmups, results)
        if "cpu" in args.sections:
            figure_cpu_wake(ctx, idle_s, rate_s, wake_samples, results)
        if "shm" in args.sections:
            figure_shm(results)
        if "path" in args.sections:
            figure_path(results, quick)
    except BaseException as err:
        status = 1
        print(f"\nFAILED: {err!r}", file=sys.stderr)
        traceback.print_exc()
        results["error"] = traceback.format_exc()
        if not isinstance(err, Exception):
            raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        for proc in multiprocessing.active_children():
            proc.kill()
            proc.join(3)
    targets = []
    for section in ("rtt", "bcast", "cpu", "wake", "shm"):
        value = results.get(section)
        if section == "rtt" and value:
            rows = [dict(r, what=f"round trip {r['placement']} {r['ratio']} N={r['readers']}")
                    for r in value["ratios"]]
        elif section in ("bcast", "wake") and value:
            rows = [dict(r, what=f"{section} {r.get('payload', r.get('transport'))} "
                               f"N={r.get('readers', 1)}") for r in value["rows"]]
        elif section == "cpu" and value:
            rows = [dict(r, what=f"cpu {r['transport']} {r['test']}") for r in value]
        elif section == "shm" and value:
            rows = [dict(value, what="default sizes, 8 readers + 8 reply queues")]
        else:
            rows = []
        targets += [[r["what"], r["target"], yes_no(r["met"])] for r in rows
                    if r.get("met") is not None]
    if targets:
        print()
        print(render("Targets", ["figure", "target", "met?"], targets, left=2))
    left = children_left()
    new_shm = sorted(dev_shm() - shm_before)
    memfds = sorted(own_memfds())
    results["children_left"] = left
    results["memfds_left"] = memfds
    results["dev_shm_new_entries"] = new_shm
    results["wall_s"] = round(time.monotonic() - started, 1)
    print()
    print(f"run took {results['wall_s']:.1f} s; children left: {left or 'none'}; "
          f"new /dev/shm entries during the run (this script makes none): "
          f"{new_shm or 'none'}; status: "
          f"{'ok' if status == 0 else 'FAILED'}")
    print(f"mpexec memfds still open or mapped in this process: {memfds or 'none'}")
    if left or memfds:
        status = 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"results written to {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
