"""The loader's one error type (``mpexec.models.config`` re-exports it)."""

from __future__ import annotations

from pathlib import Path

from mpexec.errors import MpexecError


class CheckpointError(MpexecError, ValueError):
    """A checkpoint that cannot be loaded: names the file and the field or tensor."""

    def __init__(self, path: str | Path, what: str, problem: str) -> None:
        super().__init__(f"{path}: {what}: {problem}")
        self.path = str(path)
        self.what = what
        self.problem = problem
