"""Figure 5: shared memory taken by the default queue sizes.
"""

from __future__ import annotations

import os
from typing import Any

from harness import render, yes_no

from mqbench.messages import MiB


def figure_shm(results: dict[str, Any]) -> None:
    from mpexec.ipc import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, MessageQueue
    from mpexec.ipc.layout import RingLayout

    bcast = RingLayout(8, DEFAULT_MAX_CHUNKS, DEFAULT_MAX_CHUNK_BYTES).total_bytes
    reply = RingLayout(1, DEFAULT_MAX_CHUNKS, DEFAULT_MAX_CHUNK_BYTES).total_bytes
    total = bcast + 8 * reply
    # Cross-check with a real queue: the size its handle advertises.
    queue = MessageQueue(8, 8, name="bench-size")
    try:
        handle = queue.export_handle()
        actual = handle.buffer.size if handle.buffer is not None else -1
    finally:
        queue.shutdown()
    fits = total <= 64 * MiB
    rows = [["broadcast queue, 8 readers", 1, f"{bcast / MiB:.2f}", f"{actual / MiB:.2f}"],
            ["reply queue, 1 reader", 8, f"{reply / MiB:.2f}", "-"],
            ["total", 9, f"{total / MiB:.2f}", "-"]]
    print()
    print(render(f"5. Shared memory of the default sizes ({DEFAULT_MAX_CHUNKS} chunks x "
                 f"{DEFAULT_MAX_CHUNK_BYTES // 1024} KiB), MiB",
                 ["queue", "count", "MiB each/total", "real segment"], rows, left=1))
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    shm_text = (f"{shm.f_blocks * shm.f_frsize / MiB:.0f} MiB" if shm else "absent")
    print(f"   total {total / MiB:.2f} MiB; fits in 64 MiB (target): {yes_no(fits)}.  "
          f"Segments are memfds: they are charged to memory, not to /dev/shm "
          f"(here {shm_text}), and leave no files behind.  Large messages use "
          f"separate bulk memfds (up to 16 cached per queue), not counted here.")
    results["shm"] = {"broadcast_8_bytes": bcast, "reply_1_bytes": reply, "total_bytes": total,
                      "real_broadcast_segment_bytes": actual, "fits_64MiB": fits,
                      "target": "fits in 64 MiB", "met": fits}
