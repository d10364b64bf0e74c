"""``rope_scaling`` of a checkpoint, checked and normalised (config.json form).

The kind is always under ``"rope_type"`` (``"linear"``, ``"dynamic"``,
``"llama3"``, ``"yarn"``), the numbers each form needs are present, finite
and positive, and yarn's defaults are filled in; ``None`` means plain rotary
embeddings.  GGUF metadata is first put in the same form (``config``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpexec.models.errors import CheckpointError

_ROPE_TYPES = {"linear", "dynamic", "llama3", "yarn"}


def normalize_rope_scaling(
    scaling: Any, source: str | Path, max_position_embeddings: int
) -> dict[str, Any] | None:
    """Check a config.json ``rope_scaling`` and return it with ``rope_type`` set."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise CheckpointError(source, "rope_scaling", f"expected an object, got {scaling!r}")
    out = dict(scaling)
    kind = out.pop("rope_type", None) or out.pop("type", None)
    out.pop("type", None)
    if kind in (None, "default"):
        return None
    if kind not in _ROPE_TYPES:
        raise CheckpointError(source, "rope_scaling.rope_type", f"{kind!r} is not supported "
                              f"(supported: {', '.join(sorted(_ROPE_TYPES))})")
    out["factor"] = _positive(out, "factor", source)
    if out["factor"] < 1.0:
        raise CheckpointError(source, "rope_scaling.factor",
                              f"must be a number >= 1, got {out['factor']}")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            out[key] = _positive(out, key, source, why="llama3 needs it")
        if out["low_freq_factor"] >= out["high_freq_factor"]:
            raise CheckpointError(source, "rope_scaling.low_freq_factor",
                                  "must be below high_freq_factor")
    if kind == "yarn":
        out.setdefault("original_max_position_embeddings",
                       int(max_position_embeddings / out["factor"]))
        out.setdefault("beta_fast", 32.0)
        out.setdefault("beta_slow", 1.0)
        for key in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
            out[key] = _positive(out, key, source)
        if "attention_factor" in out and out["attention_factor"] is not None:
            out["attention_factor"] = _positive(out, "attention_factor", source)
        if out["beta_fast"] <= out["beta_slow"]:
            raise CheckpointError(source, "rope_scaling.beta_fast", "must exceed beta_slow")
    return {"rope_type": kind, **out}


def _positive(scaling: Mapping[str, Any], key: str, source: str | Path,
              why: str = "") -> Any:
    value = scaling.get(key)
    if value is None:
        raise CheckpointError(source, f"rope_scaling.{key}", "missing" + (f" ({why})" if why
                                                                          else ""))
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise CheckpointError(source, f"rope_scaling.{key}",
                              f"must be a positive number, got {value!r}")
    return value
