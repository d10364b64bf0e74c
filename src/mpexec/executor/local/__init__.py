"""Workers as processes of this machine: the launcher (``launcher``) and the
wait for their ``Ready`` over ready pipes and pidfds (``ready``)."""

from mpexec.executor.local.launcher import LocalProcessLauncher, LocalWorkerHandle
from mpexec.executor.local.ready import wait_for_ready

__all__ = ["LocalProcessLauncher", "LocalWorkerHandle", "wait_for_ready"]
