"""A remote reader's ZeroMQ handshake: a writer that dies in the middle of it
is a lost peer (the wait runs on), not a CURVE or secret mismatch."""

from __future__ import annotations

import dataclasses
import socket
import threading

import pytest

zmq = pytest.importorskip("zmq")

from mpexec.ipc import MessageQueue  # noqa: E402

pytestmark = pytest.mark.usefixtures("leak_check")

SECRET = "a-test-cluster-secret-0123456789"


def test_a_writer_dying_mid_handshake_is_not_called_an_authentication_failure() -> None:
    # The "writer" accepts the connection, closes it before the ZeroMQ
    # greeting finishes (one handshake failure "with no detail"), and then
    # stops listening, as a killed process does.  The reader must go on
    # waiting for its WELCOME until its deadline, not blame the keys.
    writer = MessageQueue(1, 0, secret=SECRET, name="dies")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    handle = dataclasses.replace(writer.export_handle(),
                                 remote_subscribe_addr=f"tcp://127.0.0.1:{port}")

    def accept_once_then_die() -> None:
        conn, _ = listener.accept()
        conn.close()
        listener.close()

    dying = threading.Thread(target=accept_once_then_die, daemon=True)
    dying.start()
    reader = MessageQueue.create_from_handle(handle, 0, secret=SECRET)
    try:
        with pytest.raises(TimeoutError):
            reader.wait_until_ready(2.0)
    finally:
        dying.join(5)
        reader.shutdown()
        writer.shutdown()
