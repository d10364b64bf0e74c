"""The writer's record of what its remote readers still lack: credit and resend.

A TCP connection between a writer and a remote reader can drop; ZeroMQ
reconnects on its own, but whatever was in flight on the old connection is
gone.  So the writer keeps every message until *every* remote reader has
acknowledged it, and resends on request::

    writer                                      remote reader r
    ------                                      ---------------
    DATA k, k+1, k+2   ---- (connection drops: k+1, k+2 lost) ----X
    DATA k+3  ---------------------------------> gap: expects k+1, got k+3
               <----------- RESUME(r, next k+1, ctl c)   (also after silence)
    DATA k+1, k+2, k+3 (the same sealed frames) ----> k+1, k+2 taken; k+3 taken;
                                                  a second k+3 is a duplicate

Memory is bounded by the credit window: the writer publishes message ``s``
only once every reader acknowledged ``s - window`` (``has_credit``), so at
most ``window`` messages are kept.  A resent frame is byte for byte the frame
first sent (same sequence number, same MAC): the reader takes a frame only at
the sequence number it expects next, so a resend fills its gap and a second
copy is dropped as a duplicate.  *Resend versus replay*: both are old,
authentic frames; the reader tells them apart only by whether it asked - a
frame older than its latest RESUME point is a replay (counted in ``drops``),
one in the range it asked to be resent is a duplicate (counted apart in
``recovery``, not as a forgery).  Neither is ever unpickled twice.

The last message before the writer's shutdown has no later message to
reveal its loss, so CLOSE carries how many messages were published: a reader
with fewer asks with RESUME before it stops, and a writer whose socket saw a
connection drop stays up to ``control.CLOSE_LINGER_S`` (while a reader
lacks messages) to resend them, then CLOSEs again.

Control frames from a reader (ACK, RESUME) carry a counter in ``aux`` that
grows with every frame it sends, so an old ACK or RESUME replayed at the
writer is dropped (it could neither take back credit nor trigger resends).

Large parts of a message are copied into bytes the log owns (the caller may
reuse its arrays once ``enqueue`` returns); parts that are already immutable
``bytes`` are kept by reference.
"""

from __future__ import annotations

from collections import deque
from typing import Any


def owned(part: Any) -> Any:
    """``part`` as something no caller can change: bytes kept, anything else copied."""
    if type(part) is bytes:
        return part
    if isinstance(part, memoryview) and type(part.obj) is bytes:
        return part
    return memoryview(part).cast("B").tobytes()


class ResendLog:
    """Per-reader credit (the next sequence each reader expects) and the
    sealed frames of every message some reader still lacks."""

    def __init__(self, ranks: list[int], window: int) -> None:
        self.window = window
        self.index = {rank: i for i, rank in enumerate(ranks)}
        self.acked = dict.fromkeys(ranks, 0)     # next seq each reader expects
        self.control = dict.fromkeys(ranks, 0)   # the last control counter seen
        self.floor = 0                           # min(acked): the oldest seq kept
        # (seq, first frame per reader in ``ranks`` order, the frames after it)
        self._kept: deque[tuple[int, list[bytes], list[Any]]] = deque()

    def has_credit_for(self, seq: int) -> bool:
        return self.floor > seq - self.window

    def keep(self, seq: int, firsts: list[bytes], rest: list[Any]) -> None:
        self._kept.append((seq, firsts, rest))

    def fresh_control(self, rank: int, counter: int) -> bool:
        """True once per counter value, growing: an older one is a replay."""
        if counter <= self.control[rank]:
            return False
        self.control[rank] = counter
        return True

    def ack(self, rank: int, next_seq: int) -> None:
        """Reader ``rank`` has every message below ``next_seq``."""
        if next_seq <= self.acked[rank]:
            return
        was_floor = self.acked[rank] == self.floor
        self.acked[rank] = next_seq
        if was_floor:
            self.floor = min(self.acked.values())
            kept = self._kept
            while kept and kept[0][0] < self.floor:
                kept.popleft()

    def frames_from(self, rank: int, seq: int) -> list[list[Any]]:
        """The frames to resend to ``rank`` for every kept message from ``seq`` on."""
        i = self.index[rank]
        return [[firsts[i], *rest] for s, firsts, rest in self._kept if s >= seq]

    def __len__(self) -> int:
        return len(self._kept)
