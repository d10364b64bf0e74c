"""Figure 2: broadcast of 64 MiB (numpy, numpy read page by page, bytes) against memcpy.
"""

from __future__ import annotations

import time
from typing import Any

from harness import BenchError, render, summary, yes_no

from mqbench.messages import BIG_BYTES, BIG_ELEMS, BYTES_PROBE, TOUCH_STRIDE
from mqbench.transports import MpexecTransport, opened


def bench_memcpy(runs: int, warmups: int) -> dict[str, dict[str, float]]:
    """One 64 MiB copy, three ways: numpy into a fresh array (numpy asks for huge pages
    on large arrays), numpy into a preallocated array, and into a fresh ``bytearray``
    (plain malloc, 4 KiB pages: the page faults a reader's new ``bytes`` pays too)."""
    import numpy as np

    src = np.arange(BIG_ELEMS, dtype=np.float64)
    blob = src.tobytes()
    dst = np.empty_like(src)
    out: dict[str, list[float]] = {"fresh": [], "prealloc": [], "bytearray": []}
    for key in out:
        for k in range(warmups + runs):
            t0 = time.perf_counter_ns()
            if key == "fresh":
                copy: Any = src.copy()
            elif key == "prealloc":
                dst[:] = src
                copy = dst
            else:
                copy = bytearray(blob)
            t1 = time.perf_counter_ns()
            if len(copy) * (8 if key != "bytearray" else 1) != BIG_BYTES:
                raise BenchError(f"memcpy baseline {key}: wrong size")
            del copy
            if k >= warmups:
                out[key].append((t1 - t0) / 1e6)
    return {key: summary(values) for key, values in out.items()}


def bench_bcast(ctx: Any, n: int, runs: int, warmups: int) -> list[dict[str, Any]]:
    import numpy as np

    arr = np.arange(BIG_ELEMS, dtype=np.float64)
    blob = bytes(range(256)) * (BIG_BYTES // 256)
    half = len(arr) // 2
    out = []
    seq = 0
    with opened(MpexecTransport(ctx, n)) as t:
        assert t.fleet is not None
        with t.fleet.watchdog(120.0 + 3 * (runs + warmups) * 2.0, "64 MiB broadcasts"):
            for variant in ("numpy", "numpy + touch every page", "bytes"):
                times: list[float] = []
                for k in range(warmups + runs):
                    seq += 1
                    if variant.startswith("numpy"):
                        touch = variant != "numpy"
                        arr[-1] = seq
                        arr[half] = -seq
                        expect = (seq, float(seq), float(-seq),
                                  float(arr[::TOUCH_STRIDE].sum()) if touch else None)
                        msg: tuple[Any, ...] = (seq, "numpy", arr, touch)
                    else:
                        expect = (seq, BIG_BYTES, blob[BYTES_PROBE])
                        msg = (seq, "bytes", blob)
                    t0 = time.perf_counter_ns()
                    t.send(msg)
                    replies = t.gather()
                    t1 = time.perf_counter_ns()
                    del msg
                    for reply in replies:
                        if tuple(reply) != expect:
                            raise BenchError(f"64 MiB {variant}: reader replied {reply!r}, "
                                             f"expected {expect!r}")
                    if k >= warmups:
                        times.append((t1 - t0) / 1e6)
                out.append({"payload": variant, "readers": n, "unit": "ms", **summary(times)})
    return out


# Targets, as ratios to one warm (preallocated) 64 MiB memcpy of this run.
TARGETS = {"numpy + touch every page": 2.5, "bytes": 3.0}


def figure_bcast(ctx: Any, readers: list[int], runs: int, warmups: int,
                 results: dict[str, Any]) -> None:
    base = bench_memcpy(runs, warmups)
    rows_data = []
    for n in readers:
        rows_data += bench_bcast(ctx, n, runs, warmups)
        print(f"  .. 64 MiB broadcasts to N={n} done", flush=True)
    warm = base["prealloc"]["median"]
    labels = {"prealloc": "memcpy: dst[:] = src (warm, preallocated)",
              "fresh": "memcpy: src.copy() (fresh buffer, numpy asks for huge pages)",
              "bytearray": "memcpy: bytearray(blob) (fresh, 4 KiB pages)"}
    rows = [[label, "-", f"{base[key]['median']:.1f}", f"{base[key]['min']:.1f}",
             f"{base[key]['max']:.1f}", f"{base[key]['median'] / warm:.2f}x", "-", "-"]
            for key, label in labels.items()]
    for row in rows_data:
        ratio = row["median"] / warm
        limit = TARGETS.get(row["payload"]) if row["readers"] == 2 else None
        met = None if limit is None else ratio <= limit
        row.update(ratio_vs_warm_memcpy=ratio, target=f"<= {limit}x" if limit else "-",
                   met=met)
        rows.append([f"mpexec: {row['payload']}", row["readers"], f"{row['median']:.1f}",
                     f"{row['min']:.1f}", f"{row['max']:.1f}", f"{ratio:.2f}x",
                     row["target"], yes_no(met)])
    print()
    print(render(f"2. Broadcast of 64 MiB to N readers, each checks it and acks (ms; "
                 f"{warmups} warm-up + {runs} timed; ratio = median / warm memcpy median)",
                 ["what", "N", "median", "min", "max", "ratio", "target", "met?"], rows))
    results["bcast"] = {"memcpy": base, "rows": rows_data, "runs": runs, "warmups": warmups}
