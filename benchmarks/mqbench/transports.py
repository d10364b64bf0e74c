"""The driver end of every transport the queue benchmark compares: mpexec's
MessageQueue, the pure-Python floor, ``multiprocessing.Pipe`` and ZeroMQ.
"""

from __future__ import annotations

import pickle
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from harness import BenchError, Fleet

from mqbench.floor import FloorRing
from mqbench.messages import CALL_TIMEOUT_S, START_TIMEOUT_S
from mqbench.roles import ROLES


class Transport:
    """Driver end: ``send`` broadcasts, ``gather`` returns one reply per reader."""

    label = "?"

    def __init__(self, ctx: Any, n: int) -> None:
        self.ctx = ctx
        self.n = n
        self.fleet: Fleet | None = None

    def open(self) -> None:
        raise NotImplementedError

    def send(self, obj: Any) -> None:
        raise NotImplementedError

    def gather(self) -> list[Any]:
        raise NotImplementedError

    def _stop(self) -> None:
        """Best effort: tell the readers to leave."""
        self.send(None)

    def _release(self) -> None:
        pass

    def close(self, failing: bool) -> None:
        errors: list[str] = []
        try:
            if self.fleet is not None and self.fleet.procs and not failing:
                try:
                    self._stop()
                except Exception as err:
                    errors.append(f"stop message: {err!r}")
            if self.fleet is not None:
                errors += self.fleet.close(timeout=3.0 if failing else 15.0)
        finally:
            self._release()
        if errors and not failing:
            raise BenchError(f"{self.label} readers did not end cleanly:\n" + "\n".join(errors))


class MpexecTransport(Transport):
    label = "mpexec"

    def __init__(self, ctx: Any, n: int) -> None:
        super().__init__(ctx, n)
        self.queue: Any = None
        self.replies: list[Any] = []

    def open(self) -> None:
        from mpexec.ipc import MessageQueue

        self.queue = MessageQueue(self.n, self.n, name="bench")
        handle = self.queue.export_handle()
        self.fleet = Fleet(self.ctx, "mpexec", ROLES["mpexec"],
                           [{"handle": handle} for _ in range(self.n)])
        self.fleet.start()
        for _, _, reply_handle in self.fleet.wait_ready():
            self.replies.append(MessageQueue.create_from_handle(reply_handle, 0))
        self.queue.wait_until_ready(timeout=START_TIMEOUT_S)
        for reply in self.replies:
            reply.wait_until_ready(timeout=START_TIMEOUT_S)

    def send(self, obj: Any) -> None:
        self.queue.enqueue(obj, timeout=CALL_TIMEOUT_S)

    def gather(self) -> list[Any]:
        return [reply.dequeue(timeout=CALL_TIMEOUT_S) for reply in self.replies]

    def _stop(self) -> None:
        self.queue.enqueue(None, timeout=5.0)

    def _release(self) -> None:
        for reply in self.replies:
            reply.shutdown()
        if self.queue is not None:
            self.queue.shutdown()


class PipeTransport(Transport):
    label = "Pipe"

    def __init__(self, ctx: Any, n: int) -> None:
        super().__init__(ctx, n)
        self.conns: list[Any] = []

    def open(self) -> None:
        ends = []
        try:
            for _ in range(self.n):
                mine, theirs = self.ctx.Pipe()
                self.conns.append(mine)
                ends.append(theirs)
            self.fleet = Fleet(self.ctx, "pipe", ROLES["pipe"], [{"conn": end} for end in ends])
            self.fleet.start()
        finally:
            for end in ends:  # the readers hold their own copies now
                end.close()
        self.fleet.wait_ready()

    def send(self, obj: Any) -> None:
        for conn in self.conns:
            conn.send(obj)

    def gather(self) -> list[Any]:
        # Blocking recv(): a reader that dies (or is killed by the watchdog)
        # closes its end, which ends the wait with EOFError.
        return [conn.recv() for conn in self.conns]

    def _release(self) -> None:
        for conn in self.conns:
            conn.close()


class ZmqTransport(Transport):
    label = "ZeroMQ"

    def __init__(self, ctx: Any, n: int) -> None:
        super().__init__(ctx, n)
        self.tmp: str | None = None
        self.context: Any = None
        self.pub: Any = None
        self.pull: Any = None

    def open(self) -> None:
        import zmq

        self.tmp = tempfile.mkdtemp(prefix="bench-mq-zmq-")
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"ipc://{self.tmp}/bcast")
        self.pull = self.context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVTIMEO, int(CALL_TIMEOUT_S * 1000))
        self.pull.bind(f"ipc://{self.tmp}/reply")
        spec = {"pub": f"ipc://{self.tmp}/bcast", "pull": f"ipc://{self.tmp}/reply"}
        self.fleet = Fleet(self.ctx, "zmq", ROLES["zmq"], [dict(spec) for _ in range(self.n)])
        self.fleet.start()
        self.fleet.wait_ready()
        # Slow joiner: PUB drops what it sends before a SUB's subscription has
        # arrived, so publish "sync" until every reader has acknowledged one.
        synced: set[int] = set()
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(synced) < self.n:
            if time.monotonic() > deadline:
                raise BenchError(f"ZeroMQ: only readers {sorted(synced)} subscribed "
                                 f"within {START_TIMEOUT_S:.0f} s")
            self.pub.send(pickle.dumps((-1, "sync"), 5))
            if self.pull.poll(20):
                while self.pull.poll(0):
                    tag, rank = pickle.loads(self.pull.recv())
                    if tag != "synced":
                        raise BenchError(f"ZeroMQ: unexpected {tag!r} during sync")
                    synced.add(rank)

    def send(self, obj: Any) -> None:
        self.pub.send(pickle.dumps(obj, 5))

    def gather(self) -> list[Any]:
        pull = self.pull
        return [pickle.loads(pull.recv()) for _ in range(self.n)]

    def _release(self) -> None:
        for sock in (self.pub, self.pull):
            if sock is not None:
                sock.close(linger=0)
        if self.context is not None:
            self.context.term()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


class FloorTransport(Transport):
    label = "floor"

    def __init__(self, ctx: Any, n: int) -> None:
        super().__init__(ctx, n)
        self.bcast: FloorRing | None = None
        self.replies: list[FloorRing] = []

    def open(self) -> None:
        self.bcast = FloorRing.create(self.n)
        for _ in range(self.n):
            self.replies.append(FloorRing.create(1, reader=0))
        specs = [{"bcast": self.bcast.ref(), "reply": reply.ref()} for reply in self.replies]
        self.fleet = Fleet(self.ctx, "floor", ROLES["floor"], specs)
        self.fleet.start()
        self.fleet.wait_ready()

    def send(self, obj: Any) -> None:
        assert self.bcast is not None
        self.bcast.send(obj)

    def gather(self) -> list[Any]:
        return [reply.recv() for reply in self.replies]

    def _release(self) -> None:
        for ring in (*self.replies, self.bcast):
            if ring is not None:
                ring.close()


TRANSPORTS: dict[str, type[Transport]] = {
    "mpexec": MpexecTransport,
    "floor": FloorTransport,
    "Pipe": PipeTransport,
    "ZeroMQ": ZmqTransport,
}


@contextmanager
def opened(transport: Transport) -> Iterator[Transport]:
    """Open ``transport``; on every exit stop its readers, reap them, free it."""
    failing = True
    try:
        transport.open()
        yield transport
        failing = False
    finally:
        transport.close(failing)
