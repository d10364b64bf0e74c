"""Executors: drive the workers of one model replica.

``Executor`` is the interface (``abstract``); ``MultiprocExecutor`` runs one
process per worker (driver side in ``multiproc``, worker side in
``worker_proc``), with its state and teardown in ``lifecycle``, the calls in
flight in ``futures``, and the processes behind the ``launcher`` seam;
``UniProcExecutor`` runs a single worker in-process.  A user worker
implements the ``WorkerBase`` protocol and is built from its
``WorkerContext``.
"""

from mpexec.executor.abstract import Executor, FailureCallback
from mpexec.executor.context import WorkerContext
from mpexec.executor.futures import FutureWrapper
from mpexec.executor.launcher import (
    LocalProcessLauncher,
    LocalWorkerHandle,
    WorkerHandle,
    WorkerLauncher,
)
from mpexec.executor.lifecycle import State
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
    "WorkerBase",
    "WorkerContext",
    "WorkerHandle",
    "WorkerLauncher",
    "WorkerSpec",
    "WorkerWrapperBase",
]
