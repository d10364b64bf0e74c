"""The driver's half of the queue handshake.

``handshake`` waits for the broadcast queue first, then each reply queue in
rank order: any other order deadlocks (each worker waits on the broadcast
queue before its reply queue).  Every launcher's driver ends its start-up
with it, whatever started the workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mpexec.errors import PeerDiedError, QueueClosedError, WorkerStartupError
from mpexec.ipc import MessageQueue, QueueReader


def handshake(broadcast: MessageQueue, replies: list[QueueReader], deadline: float,
              timeout_s: float, lost: Callable[[], str | None] | None = None,
              explain_closed: Callable[[QueueClosedError], WorkerStartupError | None]
              | None = None) -> None:
    """The driver's half of the queue handshake, bounded by ``deadline``.

    ``lost``, when given, says why the start cannot finish (a follower node
    is gone, a worker stalled) or None; it is asked every
    ``_HANDSHAKE_SLICE_S`` of waiting.  Every way the handshake can fail is a
    ``WorkerStartupError``: a queue shut down under it (a worker closed its
    end, or a monitor tore the executor down meanwhile) included, explained
    by ``explain_closed`` when it knows better (which worker died, and how).
    """
    # Ensure message queues are ready.  Will deadlock if re-ordered: each
    # worker waits on the broadcast queue before its reply queue, so we
    # must finish the broadcast handshake before waiting on any reply queue.
    queues: list[MessageQueue | QueueReader] = [broadcast, *replies]
    try:
        for mq in queues:
            _wait_until_ready(mq, deadline, lost)
    except QueueClosedError as exc:  # a PeerDiedError too: which worker, and how
        error = None if explain_closed is None else explain_closed(exc)
        if error is None:
            message = (f"a worker died during the queue handshake: {exc}"
                       if isinstance(exc, PeerDiedError)
                       else f"the queue handshake was cut short: {exc}")
            error = WorkerStartupError(message, rank=exc.reader_rank)
        raise error from exc
    except TimeoutError as exc:
        raise WorkerStartupError(
            f"the queue handshake did not finish within {timeout_s:g}s "
            f"(startup_timeout_s): {exc}") from exc


# Longer than a remote reader's HELLO repeat (1 s), so that slicing the wait
# never keeps it from saying HELLO again.
_HANDSHAKE_SLICE_S = 1.5


def _wait_until_ready(mq: MessageQueue | QueueReader, deadline: float,
                      lost: Callable[[], str | None] | None) -> None:
    while True:
        now = time.monotonic()
        end = deadline if lost is None else min(deadline, now + _HANDSHAKE_SLICE_S)
        try:
            mq.wait_until_ready(max(0.0, end - now))
            return
        except TimeoutError:
            if lost is None or time.monotonic() >= deadline:
                raise
            why = lost()
            if why is not None:
                raise WorkerStartupError(why) from None
