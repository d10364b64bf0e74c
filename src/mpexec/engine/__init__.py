"""The engine: continuous batching over any executor, and the offline ``LLM`` API.

``scheduler`` (with ``block_manager`` and ``request``) decides each step;
``engine`` runs the steps on an :class:`~mpexec.executor.Executor`; ``llm``
wraps both with a tokenizer for users.  Nothing here imports torch; the
model worker the engine drives by default lives in ``mpexec.models``.
"""

from mpexec.engine.engine import Engine, EngineDeadError, EngineStats
from mpexec.engine.request import FinishReason, Request, RequestStatus
from mpexec.engine.scheduler import Scheduler, SchedulerLimits

__all__ = [
    "Engine",
    "EngineDeadError",
    "EngineStats",
    "FinishReason",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerLimits",
]
