"""``MessageQueue.create_from_process_group`` is bounded: a rank that never
attaches (it died first) gives ``TimeoutError`` naming it, not a hang."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from mpexec.ipc import MessageQueue
from mpexec.ipc.message_queue import GROUP_READY_TIMEOUT_S


class ThreadGroup:
    """Ranks as threads of this process; only some of them ever show up."""

    def __init__(self, rank: int, world_size: int, inbox: list[Any]) -> None:
        self.rank_in_group = rank
        self.world_size = world_size
        self._inbox = inbox

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.rank_in_group == src:
            self._inbox.append(obj)
            return obj
        return self._inbox[0]


def test_the_default_wait_is_bounded() -> None:
    import inspect

    default = inspect.signature(MessageQueue.create_from_process_group).parameters["timeout"]
    assert default.default == GROUP_READY_TIMEOUT_S and 0 < GROUP_READY_TIMEOUT_S < 3600


def _rank(rank: int, inbox: list[Any], timeout: float, errors: list[BaseException]
          ) -> threading.Thread:
    def run() -> None:
        while rank != 0 and not inbox:
            threading.Event().wait(0.01)
        try:
            MessageQueue.create_from_process_group(ThreadGroup(rank, 3, inbox), 4096, 2,
                                                   timeout=timeout).shutdown()
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_the_writer_names_the_rank_that_never_attached() -> None:
    inbox: list[Any] = []
    errors: list[BaseException] = []
    reader = _rank(1, inbox, 20.0, errors)  # rank 2 died: it never comes
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\] did not attach within 1s"):
        MessageQueue.create_from_process_group(ThreadGroup(0, 3, inbox), 4096, 2, timeout=1.0)
    reader.join(20)  # the writer gave up and closed: the reader is told, well before 20 s
    assert not reader.is_alive() and len(errors) == 1


@pytest.mark.timeout(30)
def test_a_reader_gives_up_when_the_handshake_does_not_finish() -> None:
    inbox: list[Any] = []
    errors: list[BaseException] = []
    writer = _rank(0, inbox, 20.0, errors)
    with pytest.raises(TimeoutError, match=r"rank 1: the writer \(rank 0\) did not finish"):
        while not inbox:
            threading.Event().wait(0.01)
        MessageQueue.create_from_process_group(ThreadGroup(1, 3, inbox), 4096, 2, timeout=1.0)
    writer.join(20)  # the reader left: the writer is told, well before 20 s
    assert not writer.is_alive() and len(errors) == 1
