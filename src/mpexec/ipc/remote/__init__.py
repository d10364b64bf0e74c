"""The remote transport of a queue: readers on other hosts, over ZeroMQ.

``writer`` (:class:`RemoteWriter`: the local ranks through a shared-memory
writer it holds, the others over one ROUTER socket; the protocol is drawn
there), ``control`` (the control frames readers send it), ``resend`` (what it
keeps until every reader has it), ``reader`` (:class:`RemoteReader`: one
DEALER socket) and ``sockets`` (the settings both ends share).  Frames are
sealed by ``mpexec.ipc.auth`` and optionally encrypted by ``mpexec.ipc.curve``,
which the executor's node channel uses too.
"""

from mpexec.ipc.remote.reader import RemoteReader
from mpexec.ipc.remote.writer import RemoteWriter

__all__ = ["RemoteReader", "RemoteWriter"]
