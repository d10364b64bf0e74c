"""What the queue benchmark sends, and how every reader answers it.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
START_TIMEOUT_S = 60.0   # readers must be started and connected within this
CALL_TIMEOUT_S = 20.0    # the driver waits at most this long for one reply
CHILD_WAIT_S = 90.0      # a reader waits at most this long for the next message
BIG_ELEMS = 8 * MiB      # float64 elements: 64 MiB
BIG_BYTES = 64 * MiB
BYTES_PROBE = 12_345     # the byte of the 64 MiB bytes a reader checks
TOUCH_STRIDE = 512       # float64 elements per 4 KiB page
MSG_TARGET_BYTES = 100
FLOOR_SLOT_BYTES = 4096


def _padding() -> str:
    for extra in range(MSG_TARGET_BYTES):
        pad = "x" * extra
        if len(pickle.dumps((1000, "execute_model", (1, 2, 3), {}, pad), 5)) >= MSG_TARGET_BYTES:
            return pad
    return ""


_PAD = _padding()


def call_message(seq: int) -> tuple[Any, ...]:
    """The small call every figure-1 round trip carries (~100 B pickled)."""
    return (seq, "execute_model", (1, 2, 3), {}, _PAD)


def _answer(msg: tuple[Any, ...], now_ns: int) -> Any:
    op = msg[1]
    if op == "execute_model":
        return msg[0]
    if op == "stamp":
        return (msg[0], now_ns - msg[2])
    if op == "cpu":
        return (msg[0], time.process_time())
    if op == "numpy":
        arr = msg[2]
        half = len(arr) // 2
        touched = float(arr[::TOUCH_STRIDE].sum()) if msg[3] else None
        return (msg[0], float(arr[-1]), float(arr[half]), touched)
    if op == "bytes":
        data = msg[2]
        return (msg[0], len(data), data[BYTES_PROBE])
    raise ValueError(f"unknown op {op!r}")


def _serve(recv: Callable[[], Any], send: Callable[[Any], None]) -> None:
    """A reader's loop: answer every message until ``None`` arrives."""
    while True:
        msg = recv()
        now_ns = time.monotonic_ns()
        if msg is None:
            return
        reply = _answer(msg, now_ns)
        del msg  # drop views of the message's memory before the writer hears back
        send(reply)
