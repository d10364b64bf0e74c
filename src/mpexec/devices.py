"""Which device the workers get when the user said "auto" (torch-free).

``cuda_available()`` answers whether torch would see a CUDA device without
importing torch: importing it starts threads (a driver with threads must
spawn its workers, which is slower than forking them), and a configuration
is built before anything else happens.  When this process has imported
torch already, torch is asked.  Otherwise the answer is read off the
machine::

    no torch installed, or a "+cpu" build           -> no
    CUDA_VISIBLE_DEVICES set to "" or "-1"          -> no
    no NVIDIA GPU in /proc/driver/nvidia/gpus and
    no /dev/nvidia<N>                               -> no
    otherwise                                       -> yes

A machine that passes these but cannot run CUDA (a driver older than the
torch build) fails at the workers' start with torch's own error; give
``device_type="cpu"`` there.
"""

from __future__ import annotations

import glob
import os
import sys
from importlib import metadata
from typing import Any

_GPUS = "/proc/driver/nvidia/gpus"


def cuda_available() -> bool:
    """Whether torch sees (or would see) a CUDA device; see the module docstring."""
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    try:
        if "+cpu" in metadata.version("torch"):
            return False
    except metadata.PackageNotFoundError:
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    try:
        if os.listdir(_GPUS):
            return True
    except OSError:
        pass
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def resolve_device_type(device: str) -> str:
    """``"cuda"`` or ``"cpu"`` as given; ``"auto"``: CUDA when visible, else CPU."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device
