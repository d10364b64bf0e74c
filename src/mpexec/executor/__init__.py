"""Executors: drive the workers of one model replica.

``Executor`` is the interface (``abstract``).  The driver core lives here:
``driver`` (the calls and the failure table over one broadcast queue),
``lifecycle`` (state and teardown), ``futures`` / ``pump`` / ``replies``
(the calls in flight), ``verdict`` (which worker died), ``termination``,
``stall``, the launcher seam (``launcher``) and the worker side
(``worker_proc``, ``worker_base``, ``watcher``).  Each way of starting
workers is a sub-package behind the seam: ``local`` (local processes),
``nodes`` (follower nodes), ``ray`` (Ray actors).  ``MultiprocExecutor``
(``multiproc``) is the driver over local processes and follower nodes,
``RayExecutor`` (``ray``) the driver over Ray actors, ``UniProcExecutor``
runs a single worker in-process.  A user worker implements the
``WorkerBase`` protocol and is built from its ``WorkerContext``.
"""

from mpexec.executor.abstract import Executor, FailureCallback
from mpexec.executor.context import WorkerContext
from mpexec.executor.futures import FutureWrapper
from mpexec.executor.launcher import WatchedWorker, WorkerExit, WorkerHandle, WorkerLauncher
from mpexec.executor.lifecycle import State
from mpexec.executor.local import LocalProcessLauncher, LocalWorkerHandle
from mpexec.executor.multiproc import MultiprocExecutor
from mpexec.executor.protocol import Ready, RemoteFailure, StartupFailed
from mpexec.executor.spec import WorkerSpec
from mpexec.executor.stats import MethodStats
from mpexec.executor.termination import TerminationPolicy, TerminationReport
from mpexec.executor.uniproc import UniProcExecutor
from mpexec.executor.worker_base import WorkerBase, WorkerWrapperBase

__all__ = [
    "Executor",
    "FailureCallback",
    "FutureWrapper",
    "LocalProcessLauncher",
    "LocalWorkerHandle",
    "MethodStats",
    "MultiprocExecutor",
    "Ready",
    "RemoteFailure",
    "StartupFailed",
    "State",
    "TerminationPolicy",
    "TerminationReport",
    "UniProcExecutor",
    "WatchedWorker",
    "WorkerBase",
    "WorkerContext",
    "WorkerExit",
    "WorkerHandle",
    "WorkerLauncher",
    "WorkerSpec",
    "WorkerWrapperBase",
]
