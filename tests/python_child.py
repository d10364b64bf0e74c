"""Running a fresh Python interpreter with this checkout's ``src`` importable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mpexec

SRC_DIR = str(Path(mpexec.__file__).resolve().parent.parent)


def run_python(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a child, output captured as text, bounded by ``timeout``."""
    env = dict(os.environ, PYTHONPATH=SRC_DIR)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_code(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` (dedented) in a fresh interpreter, as :func:`run_python`."""
    return run_python("-c", textwrap.dedent(code), timeout=timeout)
