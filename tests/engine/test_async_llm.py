"""AsyncLLM on the fake model worker: concurrent streams, abort, failures, an idle loop."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from mpexec.engine.async_llm import AsyncLLM
from mpexec.engine.engine import EngineDeadError
from mpexec.engine.validation import RequestError
from mpexec.errors import WorkerDiedError
from mpexec.outputs import SamplingParams
from tests.engine.fake_tokenizer import FakeTokenizer
from tests.engine.fake_worker import reference_tokens
from tests.engine.test_llm import fake_llm

pytestmark = pytest.mark.usefixtures("leak_check")

TOK = FakeTokenizer()
WAIT_S = 60.0


def async_llm(backend: str = "uni", **kwargs: Any) -> AsyncLLM:
    return AsyncLLM(llm=fake_llm(backend, **kwargs))


async def collect(engine: AsyncLLM, prompt: str, params: SamplingParams) -> list[Any]:
    return [out async for out in engine.generate(prompt, params)]


def test_concurrent_streams_each_get_their_own_tokens() -> None:
    prompts = [f"prompt number {i}" for i in range(12)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=5 + i)
              for i in range(12)]

    async def main(engine: AsyncLLM) -> list[list[Any]]:
        tasks = [collect(engine, p, s) for p, s in zip(prompts, params, strict=True)]
        return await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)

    with async_llm(async_scheduling=True, max_num_seqs=4) as engine:
        results = asyncio.run(main(engine))
    for prompt, p, outs in zip(prompts, params, results, strict=True):
        want, reason = reference_tokens(TOK.encode(prompt), p, eos_token_ids=(3,),
                                        max_model_len=96)
        final = outs[-1]
        assert final.finished and final.token_ids == want and final.finish_reason == reason
        assert final.text == TOK.decode(want)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == sorted(lengths)  # cumulative
        assert all(final.text.startswith(o.text) for o in outs)


def test_abort_and_leaving_a_stream_free_the_request() -> None:
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)

    async def main(engine: AsyncLLM) -> tuple[Any, int]:
        stream = engine.add_request("abort me", params, request_id="a")
        async for out in stream:
            if len(out.token_ids) >= 2:
                engine.abort("a")
                break
        async for out in engine.generate("leave me", params):
            if len(out.token_ids) >= 2:
                break  # the iterator's close aborts it
        last = await collect(engine, "then a short one", SamplingParams(max_tokens=2))
        for _ in range(200):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return last[-1], engine.engine.scheduler.blocks.num_free_blocks

    with async_llm(worker_kwargs={"step_delay_s": 0.005}) as engine:
        last, free = asyncio.run(asyncio.wait_for(main(engine), WAIT_S))
        assert last.finished
        assert not engine.engine.has_unfinished_requests()
        assert free == engine.engine.num_blocks


def test_bad_requests_fail_at_add_and_the_engine_serves_on() -> None:
    async def main(engine: AsyncLLM) -> Any:
        for prompt, params in [({"prompt_token_ids": [1, 500]}, None),
                               ({"prompt_token_ids": [1.7]}, None),
                               (None, None), ("x" * 200, None),
                               ("ok", {"max_tokens": 3})]:
            with pytest.raises(RequestError):
                engine.add_request(prompt, params)  # type: ignore[arg-type]
        return await collect(engine, "still fine", SamplingParams(max_tokens=3))

    with async_llm() as engine:
        outs = asyncio.run(asyncio.wait_for(main(engine), WAIT_S))
        assert outs[-1].finished and engine.is_healthy


def test_a_request_the_workers_refuse_fails_alone() -> None:
    poison = TOK.encode("!")[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def main(engine: AsyncLLM) -> tuple[Any, BaseException | None]:
        good = asyncio.ensure_future(collect(engine, "a good prompt", params))
        await asyncio.sleep(0.05)
        error = None
        try:
            await collect(engine, "bad!", params)
        except Exception as exc:
            error = exc
        return await good, error

    with async_llm(worker_kwargs={"refuse_token": poison, "step_delay_s": 0.005}) as engine:
        good, error = asyncio.run(asyncio.wait_for(main(engine), WAIT_S))
        assert type(error).__name__ == "WorkerError" and "refused" in str(error)
        assert good[-1].finished and len(good[-1].token_ids) == 20
        assert engine.is_healthy


def test_a_worker_death_fails_every_open_stream_and_the_engine() -> None:
    failures: list[BaseException] = []
    engine = async_llm("mp", tensor_parallel_size=2,
                       worker_kwargs={"die_at_step": 6, "fault_rank": 1})
    engine.on_failure = failures.append
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main() -> list[Any]:
        tasks = [collect(engine, f"request {i}", params) for i in range(4)]
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                      WAIT_S)

    try:
        results = asyncio.run(main())
        assert all(isinstance(r, WorkerDiedError) for r in results), results
        assert len({id(r) for r in results}) == 4  # one instance per stream
        assert not engine.is_healthy and failures

        async def again() -> None:
            engine.add_request("more", params)

        with pytest.raises(EngineDeadError):
            asyncio.run(again())
    finally:
        engine.shutdown()


def test_an_idle_engine_thread_sleeps() -> None:
    with async_llm() as engine:
        asyncio.run(collect(engine, "warm up", SamplingParams(max_tokens=2)))
        tid = engine._thread.native_id

        def cpu_ticks() -> int:
            with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        before = cpu_ticks()
        time.sleep(1.0)
        assert cpu_ticks() - before <= 2  # clock ticks (1/100 s): asleep, not polling


def test_shutdown_ends_open_streams() -> None:
    engine = async_llm(worker_kwargs={"step_delay_s": 0.01})
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)

    async def main() -> BaseException | None:
        stream = engine.add_request("long one", params)
        async for out in stream:
            if out.token_ids:
                await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
                break
        try:
            async for _ in engine.generate("x", params):
                pass
        except EngineDeadError as exc:
            return exc
        return None

    try:
        assert isinstance(asyncio.run(asyncio.wait_for(main(), WAIT_S)), EngineDeadError)
    finally:
        engine.shutdown()
