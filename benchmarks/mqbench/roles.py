"""The reader side of every transport: one role function per transport, run
in a child process by ``harness.fleet``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

from mqbench.floor import FloorRing
from mqbench.messages import CHILD_WAIT_S, START_TIMEOUT_S, _serve


def role_mpexec(rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
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


def role_pipe(rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
    conn = spec["conn"]
    try:
        ctrl.send(("ready", rank, None))
        # A dead driver closes its end: recv() then raises EOFError.
        _serve(conn.recv, conn.send)
    finally:
        conn.close()


def role_zmq(rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
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


def role_floor(rank: int, ctrl: Any, spec: dict[str, Any]) -> None:
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


ROLES: dict[str, Callable[[int, Any, dict[str, Any]], None]] = {
    "mpexec": role_mpexec,
    "pipe": role_pipe,
    "zmq": role_zmq,
    "floor": role_floor,
}
