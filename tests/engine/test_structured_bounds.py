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


def test_cancel_compiles_ends_a_compile_in_flight_and_refuses_later_ones(
        structured: Any, leak_check: None) -> None:
    """A shutting-down server does not wait a compile out (up to the time bound)."""
    import threading

    structured.compile_timeout_s = 100.0
    errors: list[BaseException] = []

    def compile_it() -> None:
        try:
            structured.guide(EXPLODING)
        except ValueError as exc:
            errors.append(exc)

    thread = threading.Thread(target=compile_it)
    thread.start()
    structured.cancel_compiles()
    thread.join(30)  # a hang guard: cancelled, it returns within a poll
    assert not thread.is_alive() and len(errors) == 1 and "shutting down" in str(errors[0])
    with pytest.raises(ValueError, match="shutting down"):
        structured.guide(GuidedDecodingParams(regex="(maybe|so)"))


def test_the_server_engine_steps_on_while_a_constraint_compiles(tiny_checkpoint: Path,
                                                                  leak_check: None) -> None:
    """AsyncLLM compiles constraints off the engine thread: a request sent
    after two whose constraints take seconds to compile finishes first, the
    slow ones end in their ValueError, and one aborted while it waited for a
    compile thread finishes aborted."""
    import asyncio

    from mpexec.engine.async_llm import COMPILE_THREADS, AsyncLLM
    from mpexec.outputs import SamplingParams

    forkserver.ensure_running()  # one helper per session, not a leak of this test

    async def last(engine: AsyncLLM, params: SamplingParams) -> Any:
        outputs = [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7]}, params)]
        return outputs[-1]

    async def main(engine: AsyncLLM) -> tuple[Any, list[Any], list[Any]]:
        slow = [asyncio.ensure_future(last(engine, SamplingParams(
            max_tokens=4, guided_decoding=EXPLODING))) for _ in range(COMPILE_THREADS)]
        dropped = engine.add_request({"prompt_token_ids": [8, 9]}, SamplingParams(
            max_tokens=4, guided_decoding=GuidedDecodingParams(regex="(yes|no)")))
        engine.abort(dropped.request_id)
        plain = await asyncio.wait_for(last(engine, SamplingParams(max_tokens=4)), 60)
        assert not any(task.done() for task in slow)  # still compiling (the bound is 3 s)
        errors = await asyncio.wait_for(asyncio.gather(*slow, return_exceptions=True), 60)
        outputs = [o async for o in dropped]
        return plain, errors, outputs

    with AsyncLLM(str(tiny_checkpoint), num_threads=1, shutdown_grace_s=2.0,
                  shutdown_term_s=2.0) as engine:
        engine.engine.builder.structured_outputs().compile_timeout_s = 3.0
        plain, errors, dropped = asyncio.run(main(engine))
    assert len(plain.token_ids) == 4
    assert all(isinstance(e, ValueError) and "did not compile within 3 s" in str(e)
               for e in errors), errors
    assert dropped[-1].finish_reason == "abort" and not dropped[-1].token_ids


def test_a_shutdown_while_constraints_compile_ends_their_streams(tiny_checkpoint: Path,
                                                                 leak_check: None) -> None:
    """The compile in flight is cancelled (it would take minutes), the one
    queued behind it never starts; both streams end with an error, none hangs."""
    import asyncio

    from mpexec.engine.async_llm import COMPILE_THREADS, AsyncLLM
    from mpexec.outputs import SamplingParams

    forkserver.ensure_running()  # one helper per session, not a leak of this test

    async def drain(stream: Any) -> BaseException | None:
        try:
            async for _ in stream:
                pass
        except Exception as exc:
            return exc
        return None

    async def main(engine: AsyncLLM) -> list[BaseException | None]:
        params = SamplingParams(max_tokens=4, guided_decoding=EXPLODING)
        streams = [engine.add_request({"prompt_token_ids": [5, 6]}, params)
                   for _ in range(COMPILE_THREADS + 1)]
        await asyncio.sleep(0.5)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        return list(await asyncio.wait_for(asyncio.gather(*map(drain, streams)), 30))

    engine = AsyncLLM(str(tiny_checkpoint), num_threads=1, shutdown_grace_s=2.0,
                      shutdown_term_s=2.0)
    try:
        engine.engine.builder.structured_outputs().compile_timeout_s = 100.0
        errors = asyncio.run(main(engine))
    finally:
        engine.shutdown()
    assert all(e is not None and "shut" in str(e) for e in errors), errors
