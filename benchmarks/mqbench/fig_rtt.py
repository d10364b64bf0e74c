"""Figure 1: round trip of a ~100-byte call message, against the baselines.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import statistics
import time
from typing import Any

from harness import PLACEMENTS, BenchError, pin, place, render, summary, yes_no

from mqbench.messages import call_message
from mqbench.transports import TRANSPORTS, opened


def bench_rtt(ctx: Any, name: str, n: int, iters: int, warmup: int,
              placement: str) -> list[float]:
    """``iters`` timed round trips (µs) after ``warmup`` untimed ones, on fresh readers."""
    transport = TRANSPORTS[name](ctx, n)
    samples: list[int] = []
    allowed = sorted(os.sched_getaffinity(0))
    try:
        with opened(transport) as t:
            assert t.fleet is not None
            place(placement, t.fleet.pids, allowed)
            limit = 60.0 + (iters + warmup) * 0.02
            with t.fleet.watchdog(limit, "round trips"):
                gc.collect()
                gc.disable()
                try:
                    for i in range(warmup + iters):
                        msg = call_message(i)
                        t0 = time.perf_counter_ns()
                        t.send(msg)
                        replies = t.gather()
                        t1 = time.perf_counter_ns()
                        if i >= warmup:
                            samples.append(t1 - t0)
                        for reply in replies:
                            if reply != i:
                                raise BenchError(f"{name}: round trip {i} got reply {reply!r}")
                finally:
                    gc.enable()
    finally:
        pin(os.getpid(), set(allowed))
    return [s / 1000 for s in samples]


def figure_rtt(ctx: Any, readers: list[int], iters: int, warmup: int, passes: int,
               placements: list[str], results: dict[str, Any]) -> None:
    """Each (placement, N, transport) runs in ``passes`` passes, transports in
    alternating order, so that a burst of load from elsewhere does not land on one
    transport only.  Samples of all passes are pooled."""
    size = len(pickle.dumps(call_message(1000), 5))
    per_pass = math.ceil(iters / passes)
    rows = []
    table: dict[tuple[str, str, int], dict[str, Any]] = {}
    for placement in placements:
        for n in readers:
            samples: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
            pass_medians: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
            for k in range(passes):
                order = list(TRANSPORTS) if k % 2 == 0 else list(reversed(TRANSPORTS))
                for name in order:
                    got = bench_rtt(ctx, name, n, per_pass, warmup, placement)
                    samples[name] += got
                    pass_medians[name].append(statistics.median(got))
                print(f"  .. round trips {placement} N={n} pass {k + 1}/{passes}: " + ", ".join(
                    f"{name} {pass_medians[name][-1]:.1f}" for name in TRANSPORTS)
                    + " µs (medians)", flush=True)
            for name in TRANSPORTS:
                res = {"placement": placement, "transport": name, "readers": n, "unit": "us",
                       **summary(samples[name]), "pass_medians": pass_medians[name]}
                table[(placement, name, n)] = res
                rows.append([placement, name, n, f"{res['median']:.1f}", f"{res['p99']:.1f}",
                             f"{res['min']:.1f}", f"{res['mean']:.1f}", res["n"],
                             " / ".join(f"{m:.1f}" for m in pass_medians[name])])
    print()
    print(render(f"1. Round trip of a {size}-byte call message, driver -> N readers -> N "
                 f"replies (µs; {passes} pass(es) x ({warmup} warm-up + {per_pass} timed))",
                 ["placement", "transport", "N", "median", "p99", "min", "mean", "samples",
                  "median per pass"], rows, left=2))
    for placement in placements:
        print(f"   {placement:8s} = {PLACEMENTS[placement]}")
    ratio_rows = []
    ratios = []
    for placement in placements:
        for n in readers:
            for label, num, den, target, want_le in (
                    ("mpexec/floor", "mpexec", "floor", 2.0 if n <= 2 else None, True),
                    ("Pipe/mpexec", "Pipe", "mpexec", 5.0, False),
                    ("ZeroMQ/mpexec", "ZeroMQ", "mpexec", 5.0, False)):
                a, b = table[(placement, num, n)], table[(placement, den, n)]
                med = a["median"] / b["median"]
                p99 = a["p99"] / b["p99"]
                if target is None:
                    met, target_text = None, "-"
                elif want_le:
                    met, target_text = med <= target, f"<= {target:g}x"
                else:
                    met, target_text = med >= target, f">= {target:g}x"
                ratios.append({"placement": placement, "ratio": label, "readers": n,
                               "median_ratio": med, "p99_ratio": p99, "target": target_text,
                               "met": met})
                ratio_rows.append([placement, label, n, f"{med:.2f}x", f"{p99:.2f}x",
                                   target_text, yes_no(met)])
    print()
    print(render("1b. Ratios of the round trips above (the target applies to the median ratio)",
                 ["placement", "ratio", "N", "median", "p99", "target", "met?"], ratio_rows,
                 left=2))
    results["rtt"] = {"message_bytes": size, "iters": per_pass * passes, "warmup": warmup,
                      "passes": passes, "placements": {p: PLACEMENTS[p] for p in placements},
                      "rows": list(table.values()), "ratios": ratios}
