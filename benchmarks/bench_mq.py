#!/usr/bin/env python3
"""Benchmark of ``mpexec.ipc.MessageQueue``, the shared-memory transport.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_mq.py [--quick] [--iters N]
        [--readers 1,2,4] [--placements free,apart,together] [--json PATH]

Figures, each compared with baselines measured in the same run:

1. round trip of a ~100-byte call message: the driver broadcasts it, each of
   N reader processes replies on its own path, the driver collects N replies.
   MessageQueue against ``multiprocessing.Pipe``, ZeroMQ over ``ipc://`` and
   the *floor*: the least a shared-memory ring can do in pure Python (one
   slot, one write counter, one read counter per reader, spin with
   ``sched_yield``), defined in this file.  On a small machine where the
   processes run matters as much as the transport (a reader spinning on the
   driver's CPU costs a context switch per hop), so each round trip is
   measured unpinned and with two pinnings (``--placements``);
2. broadcast of a 64 MiB numpy array and of 64 MiB of ``bytes`` to N readers,
   against one 64 MiB memcpy;
3. CPU used by a reader blocked in ``dequeue()``, and by one receiving
   20 messages/s, against a reader blocked on a Pipe;
4. wake-up latency of a reader that has gone to sleep (and what the spinning
   floor pays to avoid sleeping);
5. shared memory taken by the default queue sizes.

Readers are separate processes started with the ``spawn`` method.  Every wait
is bounded, children are reaped and every queue is shut down on every path.
Exit status: 0 when every measurement ran and every reply checked out
(missed targets are reported, they are not failures); 1 otherwise.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import mmap
import multiprocessing
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_SRC = Path(__file__).resolve().parent.parent / "src"
if (_SRC / "mpexec").is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

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


class BenchError(RuntimeError):
    """A measurement could not be taken, or a reply was wrong."""


# ---------------------------------------------------------------------------
# messages and the reader's side of every transport
# ---------------------------------------------------------------------------

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


def _child_main(role: str, rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
    failed = False
    try:
        _ROLES[role](rank, ctrl, spec)
    except BaseException:
        failed = True
        try:
            ctrl.send(("error", rank, traceback.format_exc()))
        except Exception:
            pass
    finally:
        try:
            ctrl.close()
        except Exception:
            pass
    if failed:
        sys.exit(1)


def _role_mpexec(rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
    from mpexec.ipc import MessageQueue

    bcast: Any = None
    reply: Any = None
    try:
        bcast = MessageQueue.create_from_handle(spec["handle"], rank)
        reply = MessageQueue(1, 1, name=f"bench-reply{rank}")
        ctrl.send(("ready", rank, reply.export_handle()))
        bcast.wait_until_ready(timeout=START_TIMEOUT_S)
        reply.wait_until_ready(timeout=START_TIMEOUT_S)
        _serve(lambda: bcast.dequeue(timeout=CHILD_WAIT_S, indefinite=True),
               lambda obj: reply.enqueue(obj, timeout=CHILD_WAIT_S))
    finally:
        if reply is not None:
            reply.shutdown()
        if bcast is not None:
            bcast.shutdown()


def _role_pipe(rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
    conn = spec["conn"]
    try:
        ctrl.send(("ready", rank, None))
        # A dead driver closes its end: recv() then raises EOFError.
        _serve(conn.recv, conn.send)
    finally:
        conn.close()


def _role_zmq(rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
    import zmq

    context = zmq.Context()
    sub = push = None
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVTIMEO, 1000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(spec["pub"])
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(spec["pull"])
        ctrl.send(("ready", rank, None))
        parent = os.getppid()
        synced = False

        def recv() -> Any:
            nonlocal synced
            waited = 0
            while True:
                try:
                    raw = sub.recv()
                except zmq.Again:
                    waited += 1
                    if waited > CHILD_WAIT_S or os.getppid() != parent:
                        raise TimeoutError("no message from the driver") from None
                    continue
                msg = pickle.loads(raw)
                if msg is not None and msg[1] == "sync":
                    if not synced:
                        push.send(pickle.dumps(("synced", rank), 5))
                        synced = True
                    continue
                return msg

        _serve(recv, lambda obj: push.send(pickle.dumps(obj, 5)))
    finally:
        for sock in (sub, push):
            if sock is not None:
                sock.close(linger=0)
        context.term()


def _role_floor(rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
    parent = os.getppid()

    def alive() -> bool:
        return os.getppid() == parent

    bcast = reply = None
    try:
        bcast = FloorRing.attach(spec["bcast"], reader=rank, alive=alive)
        reply = FloorRing.attach(spec["reply"], reader=None, alive=alive)
        ctrl.send(("ready", rank, None))
        _serve(bcast.recv, reply.send)
    finally:
        for ring in (bcast, reply):
            if ring is not None:
                ring.close()


_ROLES: dict[str, Callable[[int, Any, dict[str, Any]], None]] = {
    "mpexec": _role_mpexec,
    "pipe": _role_pipe,
    "zmq": _role_zmq,
    "floor": _role_floor,
}


# ---------------------------------------------------------------------------
# the floor: a minimal shared-memory ring in pure Python
# ---------------------------------------------------------------------------

class FloorRing:
    """One writer, ``n`` readers, one slot; waits spin with ``sched_yield``.

    Layout (u64 cells, each counter alone on a 64-byte line)::

        line 0        write_seq
        line 1 + r    read_seq of reader r
        line 1 + n    slot: u64 length, then the pickled message

    Publication is "data, then write_seq": on x86-64 (total store order)
    stores stay in order and loads stay in order, so no fence is needed.
    This is a measuring stick for the design's cost in Python, not a
    transport: it has no sleeping, no liveness checks, no large messages.
    The memory is a memfd, like mpexec's, shared through /proc/<pid>/fd.
    """

    def __init__(self, fd: int, size: int, n_readers: int, reader: int | None,
                 alive: Callable[[], bool] | None, owner: bool, timeout: float) -> None:
        self.size = size
        self.n = n_readers
        self.fd = fd if owner else -1
        self.map = mmap.mmap(fd, size)
        self.mv = memoryview(self.map)
        self.cells = self.mv.cast("Q")
        self.read_cells = [8 * (1 + r) for r in range(n_readers)]
        self.len_cell = 8 * (1 + n_readers)
        self.data_off = self.len_cell * 8 + 8
        self.capacity = size - self.data_off
        self.reader = reader
        self.my_cell = self.read_cells[reader] if reader is not None else -1
        self.seq = int(self.cells[self.my_cell] if reader is not None else self.cells[0])
        self.alive = alive
        self.timeout = timeout

    @classmethod
    def create(cls, n_readers: int, reader: int | None = None) -> FloorRing:
        size = 64 * (2 + n_readers) + FLOOR_SLOT_BYTES
        fd = os.memfd_create("bench-floor", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size, n_readers, reader, None, owner=True, timeout=CALL_TIMEOUT_S)
        except BaseException:
            os.close(fd)
            raise

    def ref(self) -> tuple[int, int, int, int]:
        return (os.getpid(), self.fd, self.size, self.n)

    @classmethod
    def attach(cls, ref: tuple[int, int, int, int], reader: int | None,
               alive: Callable[[], bool]) -> FloorRing:
        pid, fd, size, n_readers = ref
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            return cls(own, size, n_readers, reader, alive, owner=False, timeout=CHILD_WAIT_S)
        finally:
            os.close(own)

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, 5)
        cells = self.cells
        seq = self.seq
        for cell in self.read_cells:
            if cells[cell] < seq:
                self._spin(cell, seq)
        size = len(data)
        if size > self.capacity:
            raise ValueError(f"floor ring: {size} B message, slot holds {self.capacity} B")
        cells[self.len_cell] = size
        self.mv[self.data_off:self.data_off + size] = data
        cells[0] = seq + 1
        self.seq = seq + 1

    def recv(self) -> Any:
        cells = self.cells
        seq = self.seq
        if cells[0] <= seq:
            self._spin(0, seq + 1)
        size = cells[self.len_cell]
        data = bytes(self.mv[self.data_off:self.data_off + size])  # copy out, then free the slot
        cells[self.my_cell] = seq + 1
        self.seq = seq + 1
        return pickle.loads(data)

    def _spin(self, cell: int, target: int) -> None:
        cells = self.cells
        deadline = time.monotonic() + self.timeout
        polls = 0
        while cells[cell] < target:
            os.sched_yield()
            polls += 1
            if not polls & 1023:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"floor ring: waited {self.timeout:.0f} s")
                if self.alive is not None and not self.alive():
                    raise BenchError("floor ring: the driver is gone")

    def close(self) -> None:
        self.cells.release()
        self.mv.release()
        self.map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---------------------------------------------------------------------------
# the driver's side: reader processes and transports
# ---------------------------------------------------------------------------

class Fleet:
    """N reader processes, each with a control pipe; always reaped by close()."""

    def __init__(self, ctx: Any, role: str, specs: list[dict[str, Any]]) -> None:
        self.ctx = ctx
        self.role = role
        self.specs = specs
        self.procs: list[Any] = []
        self.ctrls: list[Any] = []

    def start(self) -> None:
        for rank, spec in enumerate(self.specs):
            parent, child = self.ctx.Pipe()
            try:
                proc = self.ctx.Process(target=_child_main, args=(self.role, rank, child, spec),
                                        name=f"bench-{self.role}-{rank}", daemon=True)
                proc.start()
            except BaseException:
                parent.close()
                raise
            finally:
                child.close()
            self.procs.append(proc)
            self.ctrls.append(parent)

    def recv(self, rank: int, timeout: float, what: str) -> tuple[Any, ...]:
        conn = self.ctrls[rank]
        proc = self.procs[rank]
        if not conn.poll(timeout):
            raise BenchError(f"{self.role} reader {rank}: no word within {timeout:.0f} s "
                             f"({what}); exit code {proc.exitcode}")
        try:
            msg = conn.recv()
        except EOFError:
            proc.join(2)
            raise BenchError(f"{self.role} reader {rank} exited (code {proc.exitcode}) "
                             f"during {what}") from None
        if msg[0] == "error":
            raise BenchError(f"{self.role} reader {rank} failed during {what}:\n{msg[2]}")
        return tuple(msg)

    def wait_ready(self) -> list[tuple[Any, ...]]:
        return [self.recv(rank, START_TIMEOUT_S, "start-up") for rank in range(len(self.procs))]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kill_all(self) -> None:
        for proc in self.procs:
            try:
                proc.kill()
            except Exception:
                pass

    @contextmanager
    def watchdog(self, seconds: float, what: str) -> Iterator[None]:
        """Kill the readers if ``what`` takes longer than ``seconds``: blocked calls fail."""
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            self.kill_all()

        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        except BaseException as err:
            if fired.is_set():
                raise BenchError(f"{self.role}: {what} took over {seconds:.0f} s; "
                                 "readers killed") from err
            raise
        finally:
            timer.cancel()
        if fired.is_set():
            raise BenchError(f"{self.role}: {what} took over {seconds:.0f} s; readers killed")

    def close(self, timeout: float = 15.0) -> list[str]:
        """Reap every reader (terminate/kill stragglers); return their errors."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
                proc.join(3)
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(3)
        errors = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.ctrls, strict=True)):
            detail = ""
            try:
                while conn.poll(0):
                    msg = conn.recv()
                    if msg[0] == "error":
                        detail = msg[2]
            except (EOFError, OSError):
                pass
            conn.close()
            if proc.exitcode != 0:
                errors.append(f"{self.role} reader {rank} exit code {proc.exitcode}\n{detail}")
            if proc.exitcode is not None:
                proc.close()
        return errors


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
        self.fleet = Fleet(self.ctx, "mpexec", [{"handle": handle} for _ in range(self.n)])
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
            self.fleet = Fleet(self.ctx, "pipe", [{"conn": end} for end in ends])
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
        self.fleet = Fleet(self.ctx, "zmq", [dict(spec) for _ in range(self.n)])
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
        self.fleet = Fleet(self.ctx, "floor", specs)
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


# ---------------------------------------------------------------------------
# statistics and output
# ---------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values),
            "p99": percentile(values, 99), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}


def render(title: str, headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]

    def line(row: list[str]) -> str:
        parts = [c.ljust(w) if i < left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(parts).rstrip()

    out = [title, line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def yes_no(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` from /proc (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_info() -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "cpu": model,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        from mpexec.ipc import sync

        info["mpexec_fence"] = sync.FENCE_KIND
    except Exception as err:  # reported, not fatal here
        info["mpexec_fence"] = f"unavailable ({err!r})"
    try:
        import numpy
        import zmq

        info["numpy"] = numpy.__version__
        info["pyzmq"] = f"{zmq.__version__} (libzmq {zmq.zmq_version()})"
    except Exception as err:
        info["deps"] = repr(err)
    return info


# ---------------------------------------------------------------------------
# figure 1: round trip of a small message
# ---------------------------------------------------------------------------

PLACEMENTS = {
    "free": "no pinning: the scheduler places every process (and reacts to other load)",
    "apart": "driver pinned to the first CPU, reader i to CPU (i + 1) mod nproc",
    "together": "driver and every reader pinned to the first CPU",
}


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (ZeroMQ has I/O threads) to ``cpus``."""
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass


def place(placement: str, pids: list[int], allowed: list[int]) -> None:
    if placement == "free":
        return
    first = {allowed[0]}
    pin(os.getpid(), first)
    for rank, pid in enumerate(pids):
        cpu = allowed[(rank + 1) % len(allowed)] if placement == "apart" else allowed[0]
        pin(pid, {cpu})


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


# ---------------------------------------------------------------------------
# figure 2: broadcast of 64 MiB
# ---------------------------------------------------------------------------

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


def figure_bcast(ctx: Any, readers: list[int], runs: int, warmups: int,
                 results: dict[str, Any]) -> None:
    base = bench_memcpy(runs, warmups)
    rows_data = []
    for n in readers:
        rows_data += bench_bcast(ctx, n, runs, warmups)
        print(f"  .. 64 MiB broadcasts to N={n} done", flush=True)
    fresh = base["fresh"]["median"]
    rows = [["memcpy: src.copy() (fresh buffer)", "-", f"{fresh:.1f}",
             f"{base['fresh']['min']:.1f}", f"{base['fresh']['max']:.1f}", "1.00x", "-", "-"],
            ["memcpy: dst[:] = src (preallocated)", "-", f"{base['prealloc']['median']:.1f}",
             f"{base['prealloc']['min']:.1f}", f"{base['prealloc']['max']:.1f}",
             f"{base['prealloc']['median'] / fresh:.2f}x", "-", "-"],
            ["memcpy: bytearray(blob) (fresh, 4 KiB pages)", "-",
             f"{base['bytearray']['median']:.1f}", f"{base['bytearray']['min']:.1f}",
             f"{base['bytearray']['max']:.1f}", f"{base['bytearray']['median'] / fresh:.2f}x",
             "-", "-"]]
    for row in rows_data:
        ratio = row["median"] / fresh
        has_target = row["readers"] == 2 and row["payload"] in ("numpy", "bytes")
        met = ratio <= 2.0 if has_target else None
        row.update(ratio_vs_fresh_memcpy=ratio, target="<= 2x" if has_target else "-", met=met)
        rows.append([f"mpexec: {row['payload']}", row["readers"], f"{row['median']:.1f}",
                     f"{row['min']:.1f}", f"{row['max']:.1f}", f"{ratio:.2f}x",
                     row["target"], yes_no(met)])
    print()
    print(render(f"2. Broadcast of 64 MiB to N readers, each checks it and acks (ms; "
                 f"{warmups} warm-up + {runs} timed; ratio = median / fresh memcpy median)",
                 ["what", "N", "median", "min", "max", "ratio", "target", "met?"], rows))
    results["bcast"] = {"memcpy": base, "rows": rows_data, "runs": runs, "warmups": warmups}


# ---------------------------------------------------------------------------
# figures 3 and 4: CPU while waiting, wake-up latency
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# figure 5: shared memory of the default sizes
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def _children_left() -> list[str]:
    """Live children of this process, except multiprocessing's resource tracker.

    The tracker is started by the first spawn and ends when this process does.
    """
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    me = os.getpid()
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                data = f.read()
        except OSError:
            continue
        fields = data.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and int(entry) != tracker:
            left.append(f"{entry} {data.split('(', 1)[1].rsplit(')', 1)[0]} ({fields[0]})")
    return left


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run for smoke tests (< 30 s)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed round trips per transport and N (default 6000; quick 300)")
    p.add_argument("--readers", default="1,2,4", help="reader counts for the round trips")
    p.add_argument("--placements", default="free,apart,together",
                   help="CPU placements for the round trips: " + "; ".join(
                       f"{k}: {v}" for k, v in PLACEMENTS.items()))
    p.add_argument("--passes", type=int, default=None,
                   help="round-trip passes per transport, order alternating (default 2; quick 1)")
    p.add_argument("--bcast-readers", default="1,2", help="reader counts for 64 MiB broadcasts")
    p.add_argument("--sections", default="rtt,bcast,cpu,shm",
                   help="comma list of: rtt, bcast, cpu (cpu + wake-up), shm")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--max-seconds", type=float, default=900.0,
                   help="abort (dumping stacks) if the whole run exceeds this")
    args = p.parse_args(argv)
    try:
        args.readers = [int(x) for x in args.readers.split(",") if x.strip()]
        args.bcast_readers = [int(x) for x in args.bcast_readers.split(",") if x.strip()]
    except ValueError:
        p.error("--readers / --bcast-readers take comma-separated integers")
    if not args.readers or min(args.readers) < 1 or min(args.bcast_readers or [1]) < 1:
        p.error("reader counts must be >= 1")
    args.placements = [x.strip() for x in args.placements.split(",") if x.strip()]
    if not args.placements or set(args.placements) - set(PLACEMENTS):
        p.error(f"--placements: choose from {', '.join(PLACEMENTS)}")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = args.sections - {"rtt", "bcast", "cpu", "shm"}
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    if args.iters is None:
        args.iters = 300 if args.quick else 6000
    if args.iters < 1:
        p.error("--iters must be >= 1")
    if args.passes is None:
        args.passes = 1 if args.quick else 2
    if args.passes < 1:
        p.error("--passes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)
    quick = args.quick
    warmup = 50 if quick else 500
    runs, bcast_warmups = (3, 1) if quick else (7, 2)
    idle_s = rate_s = 1.0 if quick else 5.0
    wake_samples = 20 if quick else 100

    ctx = multiprocessing.get_context("spawn")
    shm_before = _dev_shm()
    started = time.monotonic()
    info = machine_info()
    results: dict[str, Any] = {"machine": info, "quick": quick}
    print(f"bench_mq: nproc={info['nproc']} (affinity {info['affinity']}), "
          f"python {info['python']}, {info['machine']}, kernel {info['kernel']}, "
          f"cpu {info['cpu']!r}, load {info['loadavg_at_start']}")
    print(f"          mpexec fence {info.get('mpexec_fence')}, numpy {info.get('numpy')}, "
          f"pyzmq {info.get('pyzmq')}; readers are spawned processes; "
          f"{'QUICK run' if quick else 'full run'}; medians and p99 (nearest rank)")
    print(flush=True)
    status = 0
    try:
        if "rtt" in args.sections:
            figure_rtt(ctx, args.readers, args.iters, warmup, args.passes, args.placements,
                       results)
        if "bcast" in args.sections and args.bcast_readers:
            figure_bcast(ctx, args.bcast_readers, runs, bcast_warmups, results)
        if "cpu" in args.sections:
            figure_cpu_wake(ctx, idle_s, rate_s, wake_samples, results)
        if "shm" in args.sections:
            figure_shm(results)
    except BaseException as err:
        status = 1
        print(f"\nFAILED: {err!r}", file=sys.stderr)
        traceback.print_exc()
        results["error"] = traceback.format_exc()
        if not isinstance(err, Exception):
            raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        for proc in multiprocessing.active_children():
            proc.kill()
            proc.join(3)
    targets = []
    for section in ("rtt", "bcast", "cpu", "wake", "shm"):
        value = results.get(section)
        if section == "rtt" and value:
            rows = [dict(r, what=f"round trip {r['placement']} {r['ratio']} N={r['readers']}")
                    for r in value["ratios"]]
        elif section in ("bcast", "wake") and value:
            rows = [dict(r, what=f"{section} {r.get('payload', r.get('transport'))} "
                               f"N={r.get('readers', 1)}") for r in value["rows"]]
        elif section == "cpu" and value:
            rows = [dict(r, what=f"cpu {r['transport']} {r['test']}") for r in value]
        elif section == "shm" and value:
            rows = [dict(value, what="default sizes, 8 readers + 8 reply queues")]
        else:
            rows = []
        targets += [[r["what"], r["target"], yes_no(r["met"])] for r in rows
                    if r.get("met") is not None]
    if targets:
        print()
        print(render("Targets", ["figure", "target", "met?"], targets, left=2))
    left = _children_left()
    new_shm = sorted(_dev_shm() - shm_before)
    results["children_left"] = left
    results["dev_shm_new_entries"] = new_shm
    results["wall_s"] = round(time.monotonic() - started, 1)
    print()
    print(f"run took {results['wall_s']:.1f} s; children left: {left or 'none'}; "
          f"new /dev/shm entries during the run (this script makes none): "
          f"{new_shm or 'none'}; status: "
          f"{'ok' if status == 0 else 'FAILED'}")
    if left:
        status = 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"results written to {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
