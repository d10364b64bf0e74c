"""mpexec: drive N worker processes from one driver.

The driver broadcasts each call once through a shared-memory queue, the
workers run it in lockstep, and the replies come back in call order.

``import mpexec`` is cheap: the public names below are imported from their
modules on first use (PEP 562), and nothing here imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mpexec.version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "ExecutorConfig": "mpexec.config",
    "ParallelConfig": "mpexec.config",
    "SchedulerConfig": "mpexec.config",
    "Executor": "mpexec.executor",
    "LLM": "mpexec.engine.llm",
    "AsyncLLM": "mpexec.engine.async_llm",
    "SamplingParams": "mpexec.outputs",
    "MessageQueue": "mpexec.ipc",
    "Handle": "mpexec.ipc",
    "MpexecError": "mpexec.errors",
    "QueueClosedError": "mpexec.errors",
    "PeerDiedError": "mpexec.errors",
    "UndecodableMessageError": "mpexec.errors",
    "WorkerError": "mpexec.errors",
    "WorkerDiedError": "mpexec.errors",
    "WorkerStalledError": "mpexec.errors",
    "WorkerStartupError": "mpexec.errors",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from mpexec.config import (
        ExecutorConfig as ExecutorConfig,
        ParallelConfig as ParallelConfig,
        SchedulerConfig as SchedulerConfig,
    )
    from mpexec.engine.async_llm import AsyncLLM as AsyncLLM
    from mpexec.engine.llm import LLM as LLM
    from mpexec.errors import (
        MpexecError as MpexecError,
        PeerDiedError as PeerDiedError,
        QueueClosedError as QueueClosedError,
        UndecodableMessageError as UndecodableMessageError,
        WorkerDiedError as WorkerDiedError,
        WorkerError as WorkerError,
        WorkerStalledError as WorkerStalledError,
        WorkerStartupError as WorkerStartupError,
    )
    from mpexec.executor import Executor as Executor
    from mpexec.ipc import Handle as Handle, MessageQueue as MessageQueue
    from mpexec.outputs import SamplingParams as SamplingParams


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mpexec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
