"""Executors: drive the workers of one model replica.

``Executor`` is the interface (``abstract``); ``MultiprocExecutor`` runs one
process per worker (driver side in ``multiproc``, worker side in
``worker_proc``); ``UniProcExecutor`` runs a single worker in-process.  A user
worker implements the ``WorkerBase`` protocol.
"""

from mpexec.executor.abstract import Executor, FailureCallback
from mpexec.executor.context import WorkerContext
from mpexec.executor.futures import FutureWrapper
from mpexec.executor.multiproc import MultiprocExecutor
from mpexec.executor.stats import MethodStats
from mpexec.executor.termination import TerminationPolicy, TerminationReport
from mpexec.executor.uniproc import UniProcExecutor
from mpexec.executor.worker_base import WorkerBase, WorkerWrapperBase

__all__ = [
    "Executor",
    "FailureCallback",
    "FutureWrapper",
    "MethodStats",
    "MultiprocExecutor",
    "TerminationPolicy",
    "TerminationReport",
    "UniProcExecutor",
    "WorkerBase",
    "WorkerContext",
    "WorkerWrapperBase",
]
