"""How an exception becomes the one line a user of the command sees.

``classify`` says whether it was the user's mistake ("usage": exit status 2)
or a failure while running ("failed": exit status 1), and words it.
"""

from __future__ import annotations

from mpexec.errors import WorkerDiedError, WorkerError, WorkerStartupError


def _named(exc: BaseException, name: str) -> bool:
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def classify(exc: BaseException) -> tuple[str, str]:
    """``("usage" | "failed", message)`` for an exception out of a subcommand."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, WorkerDiedError):
        return "failed", f"a worker died: {text}"
    if isinstance(exc, WorkerStartupError):
        return "failed", f"the workers could not start: {text}"
    if isinstance(exc, WorkerError):
        return "failed", f"a worker failed: {text}"
    if _named(exc, "EngineDeadError"):
        return "failed", text
    if _named(exc, "ModelFetchError"):
        return "failed", text
    if isinstance(exc, (ValueError, FileNotFoundError, NotADirectoryError)):
        return "usage", text
    return "failed", f"{type(exc).__name__}: {text}"
