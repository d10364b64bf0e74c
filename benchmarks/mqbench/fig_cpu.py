"""Figures 3 and 4: CPU of a waiting reader, and the wake-up latency of a sleeping one.
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

from harness import BenchError, proc_cpu_s, render, summary, yes_no

from mqbench.messages import call_message
from mqbench.transports import TRANSPORTS, Transport, opened


class Probe:
    """Reader CPU seconds (its own process_time, and /proc) between two points."""

    def __init__(self, transport: Transport) -> None:
        self.t = transport
        self.seq = 10**9
        assert transport.fleet is not None
        self.pid = transport.fleet.pids[0]

    def take(self) -> tuple[float, float, float]:
        self.seq += 1
        self.t.send((self.seq, "cpu"))
        (reply,) = self.t.gather()
        if reply[0] != self.seq:
            raise BenchError(f"cpu probe: got {reply!r}")
        return time.monotonic(), reply[1], proc_cpu_s(self.pid)

    @staticmethod
    def delta(a: tuple[float, float, float], b: tuple[float, float, float]) -> dict[str, float]:
        wall = b[0] - a[0]
        cpu = b[1] - a[1]
        return {"wall_s": wall, "cpu_s": cpu, "proc_stat_cpu_s": b[2] - a[2],
                "core_pct": 100 * cpu / wall}


def run_idle(t: Transport, seconds: float) -> dict[str, float]:
    probe = Probe(t)
    a = probe.take()
    time.sleep(seconds)
    return Probe.delta(a, probe.take())


def run_rate(t: Transport, seconds: float, rate: float) -> dict[str, float]:
    probe = Probe(t)
    a = probe.take()
    count = max(1, int(seconds * rate))
    start = time.monotonic()
    for i in range(count):
        pause = start + (i + 1) / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        t.send(call_message(i))
        (reply,) = t.gather()
        if reply != i:
            raise BenchError(f"rate test: message {i} got reply {reply!r}")
    res = Probe.delta(a, probe.take())
    res["messages"] = count
    return res


def run_wake(t: Transport, samples: int, gap_s: float) -> dict[str, Any]:
    probe = Probe(t)
    a = probe.take()
    lat = []
    send = []
    for i in range(samples):
        time.sleep(gap_s)
        stamp = time.monotonic_ns()
        t.send((i, "stamp", stamp))
        send.append((time.monotonic_ns() - stamp) / 1000)
        (reply,) = t.gather()
        if reply[0] != i:
            raise BenchError(f"wake test: message {i} got reply {reply!r}")
        lat.append(reply[1] / 1000)
    cpu = Probe.delta(a, probe.take())
    return {"unit": "us", **summary(lat), "reader_core_pct": cpu["core_pct"],
            "send_call_median_us": statistics.median(send)}


def cold_penalty(samples: int, gap_s: float) -> list[dict[str, Any]]:
    """What this machine charges for the first work after sleeping ``gap_s``: the same
    operation timed first thing after the sleep, then again at once."""
    msg = call_message(1000)
    ops: list[tuple[str, Callable[[], Any]]] = [
        ("os.sched_yield()", os.sched_yield),
        ("pickle.loads(pickle.dumps(call message))", lambda: pickle.loads(pickle.dumps(msg, 5))),
    ]
    out = []
    for label, op in ops:
        cold, hot = [], []
        for _ in range(samples):
            time.sleep(gap_s)
            t0 = time.perf_counter_ns()
            op()
            t1 = time.perf_counter_ns()
            op()
            t2 = time.perf_counter_ns()
            cold.append((t1 - t0) / 1000)
            hot.append((t2 - t1) / 1000)
        out.append({"op": label, "cold_median_us": statistics.median(cold),
                    "hot_median_us": statistics.median(hot)})
    return out


def figure_cpu_wake(ctx: Any, idle_s: float, rate_s: float, wake_samples: int,
                    results: dict[str, Any]) -> None:
    gap_s = 0.030
    cpu_rows = []
    wake_rows = []
    for name in ("mpexec", "Pipe", "floor"):
        with opened(TRANSPORTS[name](ctx, 1)) as t:
            assert t.fleet is not None
            budget = 60.0 + idle_s + rate_s * 2 + wake_samples * (gap_s + 0.05)
            with t.fleet.watchdog(budget, "cpu and wake-up tests"):
                wake = run_wake(t, wake_samples, gap_s)
                wake["transport"] = name
                wake_rows.append(wake)
                if name != "floor":  # the floor spins: its CPU shows in the wake-up table
                    idle = run_idle(t, idle_s)
                    idle.update(transport=name, test=f"blocked, idle {idle_s:g} s")
                    rate = run_rate(t, rate_s, 20.0)
                    rate.update(transport=name, test=f"20 msg/s for {rate_s:g} s")
                    cpu_rows += [idle, rate]
        print(f"  .. cpu / wake-up tests for {name} done", flush=True)
    rows = []
    for row in cpu_rows:
        target, met = "-", None
        if row["transport"] == "mpexec" and row["test"].startswith("blocked"):
            per_5s = row["cpu_s"] * 5.0 / row["wall_s"]
            target, met = "< 0.05 CPU-s per 5 s", per_5s < 0.05
            row["cpu_s_per_5s"] = per_5s
        elif row["transport"] == "mpexec":
            target, met = "< 5% of a core", row["core_pct"] < 5.0
        row.update(target=target, met=met)
        rows.append([row["transport"], row["test"], f"{row['wall_s']:.2f}",
                     f"{row['cpu_s']:.4f}", f"{row['proc_stat_cpu_s']:.2f}",
                     f"{row['core_pct']:.2f}%", target, yes_no(met)])
    print()
    print(render("3. CPU used by one reader process (reader's own process_time; /proc/<pid>/stat "
                 "as a cross-check at clock-tick resolution)",
                 ["transport", "test", "wall s", "CPU s", "/proc CPU s", "of a core", "target",
                  "met?"], rows, left=2))
    rows = []
    for row in wake_rows:
        target, met = "-", None
        if row["transport"] == "mpexec":
            target, met = "median < 100 µs", row["median"] < 100.0
        row.update(target=target, met=met)
        rows.append([row["transport"], f"{row['median']:.1f}", f"{row['p99']:.1f}",
                     f"{row['min']:.1f}", f"{row['max']:.1f}", row["n"],
                     f"{row['send_call_median_us']:.1f}",
                     f"{row['reader_core_pct']:.1f}%", target, yes_no(met)])
    print()
    print(render(f"4. Wake-up latency of a reader idle for {gap_s * 1000:.0f} ms: send "
                 "(monotonic_ns before enqueue) -> receive (after dequeue) in µs",
                 ["transport", "median", "p99", "min", "max", "samples", "send call",
                  "reader CPU during test", "target", "met?"], rows, left=1))
    cold = cold_penalty(max(10, wake_samples // 2), gap_s)
    print()
    print(render(f"4b. This machine after {gap_s * 1000:.0f} ms asleep: the same call first "
                 "thing after the sleep (cold) and right after (hot), µs medians",
                 ["operation", "cold", "hot"],
                 [[c["op"], f"{c['cold_median_us']:.1f}", f"{c['hot_median_us']:.1f}"]
                  for c in cold], left=1))
    results["cpu"] = cpu_rows
    results["wake"] = {"gap_s": gap_s, "rows": wake_rows, "cold_penalty": cold}
