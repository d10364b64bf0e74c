"""Which device the workers get when the user said "auto".

``cuda_available()`` answers whether torch would see a CUDA device, but
imports torch only when it has to: importing torch starts threads (a driver
with threads must spawn its workers, which is slower than forking them), and
a CPU-only machine should not pay for that just to learn it has no GPU.  The
cheap answers come first: torch already imported (ask it), no torch, a
``+cpu`` build of torch, ``CUDA_VISIBLE_DEVICES`` hiding every device, or no
NVIDIA driver on the machine.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Any

# Where the NVIDIA driver shows itself; neither exists on a machine without one.
_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl")


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (see the module docstring)."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            if "+cpu" in metadata.version("torch"):
                return False
        except metadata.PackageNotFoundError:
            return False
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
            return False
        if not any(os.path.exists(path) for path in _DRIVER_PATHS):
            return False
        import torch
    return bool(torch.cuda.is_available())


def resolve_device_type(device: str) -> str:
    """``"cuda"`` or ``"cpu"`` as given; ``"auto"``: CUDA when visible, else CPU."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device
