"""One executor across several machines: the leader's side (``leader``), a
follower's side (``follower``, what ``mpexec node`` runs), a follower node as
one worker handle of the leader's lifecycle (``handle``), and the frames and
rules they exchange (``wire``).

A follower starts its own workers as local processes (``executor.local``);
``nodes`` is the one launcher sub-package allowed to build on another.
"""

from mpexec.executor.nodes.follower import run_follower
from mpexec.executor.nodes.handle import RemoteNodeHandle
from mpexec.executor.nodes.leader import NodeServer

__all__ = ["NodeServer", "RemoteNodeHandle", "run_follower"]
