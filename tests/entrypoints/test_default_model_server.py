"""The server on the default model (SmolLM2-135M-Instruct): real answers, equal to LLM."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.entrypoints.server_proc import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(900)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("default") as proc:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.log()


@pytest.mark.usefixtures("leak_check")
def test_a_real_answer_streamed_equals_llm_chat(server: ServerProcess) -> None:
    from mpexec import LLM, SamplingParams

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300,
                           max_retries=0)
    chunks = list(client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=24, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "Paris" in text
    with LLM("default", executor_backend="uni", num_threads=1) as llm:
        want = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0].text
    assert text == want
