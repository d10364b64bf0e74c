"""The queue as a state machine, checked against a model by hypothesis.

One writer and two readers share this process; hypothesis interleaves
enqueues and dequeues (small and bulk-sized messages, views held and
dropped) and checks every step against a plain model: a list of messages
and one read position per reader.  The ring holds ``max_chunks`` messages
that some reader has not consumed; the writer may run that far ahead of the
slowest reader and no further.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mpexec.ipc import MessageQueue

CHUNKS = 3
CHUNK_BYTES = 2048


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.writer = MessageQueue(2, 2, max_chunk_bytes=CHUNK_BYTES, max_chunks=CHUNKS,
                                   spin_s=0.0)
        handle = self.writer.export_handle()
        self.readers = [MessageQueue.create_from_handle(handle, r, spin_s=0.0) for r in (0, 1)]
        self.sent: list[Any] = []
        self.read = [0, 0]
        self.held: list[Any] = []

    def in_flight(self) -> int:
        return len(self.sent) - min(self.read)

    @rule(size=st.sampled_from([0, 10, 1500, 5000, 40_000]), tag=st.integers(0, 10**6))
    def enqueue(self, size: int, tag: int) -> None:
        message = (tag, np.full(size // 8, tag, dtype=np.int64)) if size > 2000 else (
            tag, b"m" * size)
        if self.in_flight() == CHUNKS:
            with pytest.raises(TimeoutError):
                self.writer.enqueue(message, timeout=0)
            return
        self.writer.enqueue(message, timeout=0)
        self.sent.append(message)

    @rule(reader=st.integers(0, 1), keep=st.booleans())
    def dequeue(self, reader: int, keep: bool) -> None:
        if self.read[reader] == len(self.sent):
            with pytest.raises(TimeoutError):
                self.readers[reader].dequeue(timeout=0)
            return
        got = self.readers[reader].dequeue(timeout=0)
        want = self.sent[self.read[reader]]
        self.read[reader] += 1
        assert got[0] == want[0]
        if isinstance(want[1], np.ndarray):
            assert np.array_equal(got[1], want[1])
            got[1][:1] = -1  # private copy-on-write view: must not disturb the other reader
        else:
            assert got[1] == want[1]
        if keep:
            self.held.append(got)

    @precondition(lambda self: self.held)
    @rule()
    def drop_held(self) -> None:
        self.held.pop(0)

    @invariant()
    def held_views_keep_their_content(self) -> None:
        for tag, payload in self.held:
            if isinstance(payload, np.ndarray) and len(payload) > 1:
                assert payload[-1] == tag

    def teardown(self) -> None:
        self.held.clear()
        for reader in self.readers:
            reader.shutdown()
        self.writer.shutdown()


QueueMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None)
test_queue_state_machine = pytest.mark.usefixtures("leak_check")(QueueMachine.TestCase)
