"""Compiling a structured-output constraint is bounded in time and memory.

The automaton of ``{"type": "string", "maxLength": 24}`` grows exponentially
(minutes, gigabytes); compiled on the engine thread it froze every request
of the server with it and SIGTERM could not stop it.  It is compiled in a
child process now: past the bounds that child is killed and the request gets
a ``ValueError``; nothing is left behind and the next constraint compiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest

from mpexec.outputs import GuidedDecodingParams

pytest.importorskip("outlines_core")
pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]

EXPLODING = GuidedDecodingParams(json={"type": "string", "maxLength": 24})


@pytest.fixture
def structured(tiny_checkpoint: Path) -> Iterator[Any]:
    from mpexec.engine.structured import StructuredOutputs
    from mpexec.models.tokenizer import Tokenizer

    forkserver.ensure_running()  # one helper per session, not a leak of this test
    tokenizer = Tokenizer.from_hf_dir(tiny_checkpoint)
    yield StructuredOutputs(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids[0])


def test_a_constraint_past_the_time_bound_is_a_value_error(structured: Any,
                                                           leak_check: None) -> None:
    structured.compile_timeout_s = 3.0
    with pytest.raises(ValueError, match=r"did not compile within 3 s"):
        structured.guide(EXPLODING)
    guide = structured.guide(GuidedDecodingParams(regex="(yes|no)"))
    assert guide is not None


def test_a_constraint_past_the_memory_bound_is_a_value_error(structured: Any,
                                                             leak_check: None) -> None:
    structured.compile_memory_bytes = 64 << 20
    structured.compile_timeout_s = 60.0
    with pytest.raises(ValueError, match=r"cannot compile 'a\{100000\}'"):
        structured.guide(GuidedDecodingParams(regex="a{100000}"))


def test_compiled_automata_kept_are_bounded(structured: Any, leak_check: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.engine import structured as module

    monkeypatch.setattr(module, "COMPILED_KEPT", 3)
    for i in range(5):
        structured.guide(GuidedDecodingParams(choice=[f"c{i}"]))
    assert list(structured._indexes) == ["(c2)", "(c3)", "(c4)"]
    structured.guide(GuidedDecodingParams(choice=["c2"]))  # reused: most recent now
    assert list(structured._indexes) == ["(c3)", "(c4)", "(c2)"]
