"""The engine: continuous batching over any executor, the offline ``LLM`` API
and the asyncio ``AsyncLLM``.

``scheduler`` (with ``block_manager`` and ``request``) decides each step;
``engine`` runs the steps on an :class:`~mpexec.executor.Executor`; ``llm``
wraps both with a tokenizer for users, and ``startup`` builds what it wraps
from its arguments (the workers of every replica, the tokenizer, the engine);
``dp`` puts data parallel replicas behind one engine's API; ``async_llm``
runs the same loop on its own thread for asyncio servers; ``validation``
checks every request before it reaches the scheduler.  Nothing here imports torch; the model
worker the engine drives by default lives in ``mpexec.models``.
"""

from mpexec.engine.async_llm import AsyncLLM
from mpexec.engine.engine import Engine, EngineDeadError, EngineStats
from mpexec.engine.request import FinishReason, Request, RequestStatus
from mpexec.engine.scheduler import Scheduler, SchedulerLimits

__all__ = [
    "AsyncLLM",
    "Engine",
    "EngineDeadError",
    "EngineStats",
    "FinishReason",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerLimits",
]
