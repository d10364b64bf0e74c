"""The OpenAI server on the tiny checkpoint, driven by the real ``openai`` client.

One server for the module (``python -m mpexec serve``, TP=1 worker process);
the greedy outputs it streams must equal ``LLM.generate`` of the same prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.server_proc import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(600)]

MODEL = "tiny"
PROMPTS = [f"the quick brown fox {i} jumps over" for i in range(32)]
CHAT = [{"role": "user", "content": "hello world, what is a tensor?"}]
MAX_TOKENS = 12


@dataclasses.dataclass
class Reference:
    texts: list[str]
    token_counts: list[int]
    reasons: list[str | None]
    chat_text: str


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> Reference:
    """Greedy outputs of the offline API, in this process (uni executor)."""
    from mpexec import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(str(tiny_checkpoint), executor_backend="uni", num_threads=1) as llm:
        outs = llm.generate(PROMPTS, params)
        chat = llm.chat(CHAT, params)[0]
    return Reference([o.text for o in outs], [len(o.token_ids) for o in outs],
                     [o.finish_reason for o in outs], chat.text)


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    with ServerProcess(str(tiny_checkpoint), "--served-model-name", MODEL,
                       "--max-num-seqs", "64", "--shutdown-grace", "5") as proc:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120,
                         max_retries=0)


def test_models_and_health(client: Any, server: ServerProcess) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_equals_llm_generate(client: Any, reference: Reference) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert out.choices[0].text == reference.texts[0]
    assert out.choices[0].finish_reason == reference.reasons[0]
    assert out.usage.completion_tokens == reference.token_counts[0]
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[1],
                                         max_tokens=MAX_TOKENS, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == reference.texts[1]
    assert chunks[-1].choices[0].finish_reason == reference.reasons[1]
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_several_prompts_and_n(client: Any, reference: Reference) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS,
                                    temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [t for t in reference.texts[:3] for _ in range(2)]
    sampled = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                        temperature=1.0, seed=7, n=2)
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                      temperature=1.0, seed=7, n=2)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seeded


def test_chat_equals_llm_chat(client: Any, reference: Reference) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reference.chat_text
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.chat_text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_logprobs(client: Any) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5,
                                    temperature=0, logprobs=1)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == out.usage.completion_tokens
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert "".join(logprobs.tokens)  # the tokens' own texts


def test_stop_strings_when_the_engine_has_them(client: Any) -> None:
    from mpexec.outputs import SamplingParams

    if "stop" not in {f.name for f in dataclasses.fields(SamplingParams)}:
        with pytest.raises(openai.BadRequestError, match="stop: not supported"):
            client.completions.create(model=MODEL, prompt="x", stop=["a"])
        return
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                     temperature=0).choices[0].text
    stop = full[3:5]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0, stop=[stop]).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"


def test_32_concurrent_streaming_clients(server: ServerProcess, reference: Reference) -> None:
    async def one(client: Any, index: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0,
            stream=True)
        text, reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      timeout=300, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))

    results = asyncio.run(asyncio.wait_for(main(), 400))
    assert [text for text, _ in results] == reference.texts
    assert [reason for _, reason in results] == reference.reasons


def metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_a_client_that_disconnects_frees_its_request(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server, "mpexec_num_requests_running") == 1
    assert_all_freed(server)
    # A non-streaming client that gives up: the server notices within a second or
    # so.  It gives up well before 400 tokens can be done: the prompt is cached by
    # now, and on a quiet machine the tiny model finishes them in about a second.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False},
                   timeout=httpx.Timeout(60, read=0.25))
    assert_all_freed(server)


def assert_all_freed(server: ServerProcess) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if metric(server, "mpexec_num_requests_running") == 0 \
                and metric(server, "mpexec_kv_cache_usage_ratio") == 0:
            break
        time.sleep(0.1)
    assert metric(server, "mpexec_num_requests_running") == 0
    assert metric(server, "mpexec_kv_cache_usage_ratio") == 0  # the blocks came back


@pytest.mark.parametrize(("body", "match"), [
    (b"{not json", "malformed JSON"),
    ({"model": "other", "prompt": "x"}, "the model 'other' does not exist"),
    ({"model": MODEL, "prompt": [1] * 600}, "the prompt has 600 tokens; the context holds 512"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature must be >= 0"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p must be in"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"model": MODEL, "prompt": [5, 100000]}, r"prompt_token_ids\[1\] = 100000 is outside"),
    ({"model": MODEL, "prompt": [5, -3]}, r"prompt_token_ids\[1\] = -3 is outside"),
    ({"model": MODEL, "prompt": [5, 1.7]}, "prompt"),
    ({"model": MODEL, "prompt": None}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "\ud800"}, "not valid Unicode"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n: must be an integer >= 1"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_requests_are_400s_in_the_openai_shape(server: ServerProcess, body: Any,
                                                   match: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert re.search(match, error["message"]), error
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_chat_requests(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="the model 'gpt-4' does not exist"):
        client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tokens["count"]
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 10**9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_metrics(server: ServerProcess, client: Any) -> None:
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("mpexec_num_requests_running", "mpexec_num_requests_waiting",
                 "mpexec_kv_cache_usage_ratio", "mpexec_prompt_tokens_total",
                 "mpexec_generation_tokens_total", "mpexec_time_to_first_token_seconds_bucket",
                 "mpexec_inter_token_latency_seconds_bucket",
                 'mpexec_executor_call_latency_seconds{method="execute_model",quantile="0.5"}',
                 'mpexec_requests_total{finish_reason="length"}'):
        assert name in text, name
    assert metric(server, "mpexec_generation_tokens_total") >= 3
    steps = metric(server, "mpexec_engine_step_seconds_total")
    assert 0 < metric(server, "mpexec_engine_worker_seconds_total") <= steps
    assert metric(server, "mpexec_engine_steps_total") >= 3


def test_the_readme_client_example_runs(server: ServerProcess) -> None:
    import subprocess
    import sys

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
                 if "OpenAI(" in b)
    code = block.replace("http://127.0.0.1:8000/v1", f"{server.url}/v1") \
        .replace('model="default"', f'model="{MODEL}"')
    assert code.count(server.url) == 1 and code.count(f'model="{MODEL}"') == 2
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_structured_output_through_response_format_and_guided_fields(client: Any) -> None:
    import json

    pytest.importorskip("outlines_core")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=32,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": schema}})
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                       temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match=r"guided_decoding\.regex"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "(a"})
