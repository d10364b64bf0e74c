"""The OpenAI server against hostile clients, on one server for the module.

Absurd payloads each get a 400-class OpenAI error (never a 500, a crash or a
hang) and the server serves on; clients that drop a stream mid-way (many at
once, after the first chunk or before any) have their requests aborted in the
engine (the scheduler empty and no KV block in use afterwards, read from
``/metrics``); slow readers that never read their streams do not hold up
another client.  A body over ``--max-request-bytes`` is a 413 before it is
read, whether it declares its length or comes chunked.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mpexec.entrypoints.protocol import MAX_STOP_STRINGS
from tests.entrypoints.server_proc import ServerProcess

pytest.importorskip("fastapi")
pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

MODEL = "tiny"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
IDLE_WAIT_S = 60.0
MAX_BODY = 6 * 1024 * 1024  # the module server's --max-request-bytes (default 8 MiB)


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    with ServerProcess(str(tiny_checkpoint), "--served-model-name", MODEL,
                       "--max-num-seqs", "64", "--max-request-bytes", str(MAX_BODY)) as proc:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.log()


def gauges(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out = {}
    for name in ("running", "waiting"):
        found = re.search(rf"^mpexec_num_requests_{name}\{{[^}}]*\}} (\S+)", text, re.M)
        assert found, text[:2000]
        out[name] = float(found.group(1))
    found = re.search(r"^mpexec_kv_cache_usage_ratio\{[^}]*\} (\S+)", text, re.M)
    assert found, text[:2000]
    out["kv"] = float(found.group(1))
    return out


def wait_idle(server: ServerProcess) -> None:
    """Bounded wait until no request is queued or running and no KV block is in use."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        now = gauges(server)
        if now == {"running": 0.0, "waiting": 0.0, "kv": 0.0}:
            return
        assert time.monotonic() < deadline, f"requests left in the engine: {now}"
        time.sleep(0.2)


def still_serves(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    reply = httpx.post(f"{server.url}{CMPL}", timeout=120,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 2,
                             "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def raw_request(server: ServerProcess, path: str, body: bytes,
                content_type: str = "application/json") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# (path, raw body, content type): each one a 4xx in the OpenAI error shape
PAYLOADS: dict[str, tuple[str, bytes, str]] = {
    "max_tokens 10**9": (CMPL, _json({"prompt": "hi", "max_tokens": 10**9}), ""),
    "chat max_tokens 10**9": (CHAT, _json({"messages": MSG, "max_tokens": 10**9}), ""),
    "max_completion_tokens 10**30": (CHAT, _json({"messages": MSG,
                                                  "max_completion_tokens": 10**30}), ""),
    "max_tokens -1": (CMPL, _json({"prompt": "hi", "max_tokens": -1}), ""),
    "n 10**6": (CMPL, _json({"prompt": "hi", "n": 10**6, "max_tokens": 1}), ""),
    "chat n 10**6": (CHAT, _json({"messages": MSG, "n": 10**6, "max_tokens": 1}), ""),
    "n 0": (CMPL, _json({"prompt": "hi", "n": 0}), ""),
    "prompts x n": (CMPL, _json({"prompt": ["hi"] * 64, "n": 64, "max_tokens": 1}), ""),
    "20 MB prompt": (CMPL, _json({"prompt": "a " * 10_000_000, "max_tokens": 1}), ""),
    "20 MB chat message": (CHAT, _json({"messages": [{"role": "user",
                                                      "content": "a " * 10_000_000}]}), ""),
    # under the body bound: refused from a prefix of the text (encode_within)
    "4 MB prompt": (CMPL, _json({"prompt": "a " * 2_000_000, "max_tokens": 1}), ""),
    "4 MB chat message": (CHAT, _json({"messages": [{"role": "user",
                                                     "content": "a " * 2_000_000}]}), ""),
    "4 MB tokenize prompt": ("/tokenize", _json({"prompt": "a " * 2_000_000}), ""),
    "100,000 messages": (CHAT, _json({"messages": MSG * 100_000, "max_tokens": 1}), ""),
    "token id above vocab": (CMPL, _json({"prompt": [1, 2, 10**12], "max_tokens": 1}), ""),
    "negative token id": (CMPL, _json({"prompt": [[1], [-2]], "max_tokens": 1}), ""),
    "temperature NaN": (CMPL, b'{"prompt": "hi", "temperature": NaN}', ""),
    "temperature inf": (CMPL, b'{"prompt": "hi", "temperature": Infinity}', ""),
    "temperature -1": (CMPL, _json({"prompt": "hi", "temperature": -1}), ""),
    "top_p 0": (CMPL, _json({"prompt": "hi", "top_p": 0}), ""),
    "top_p 2": (CMPL, _json({"prompt": "hi", "top_p": 2}), ""),
    "top_k -5": (CMPL, _json({"prompt": "hi", "top_k": -5}), ""),
    "chat top_k -2": (CHAT, _json({"messages": MSG, "top_k": -2}), ""),
    "repetition_penalty 1e-308": (CMPL, _json({"prompt": "hi",
                                               "repetition_penalty": 1e-308}), ""),
    "repetition_penalty 1e308": (CMPL, _json({"prompt": "hi", "repetition_penalty": 1e308}), ""),
    "presence_penalty -3": (CMPL, _json({"prompt": "hi", "presence_penalty": -3}), ""),
    "100,000 stop strings": (CMPL, _json({"prompt": "hi",
                                          "stop": [f"s{i}" for i in range(100_000)]}), ""),
    "a 1 MB stop string": (CMPL, _json({"prompt": "hi", "stop": "x" * 1_000_000}), ""),
    # its automaton grows exponentially: the compile is stopped at its bound (30 s)
    "JSON string maxLength 24": (CMPL, _json({"prompt": "hi", "max_tokens": 2, "guided_json": {
        "type": "string", "maxLength": 24}}), ""),
    "logprobs 10**6": (CMPL, _json({"prompt": "hi", "logprobs": 10**6}), ""),
    "chat top_logprobs -1": (CHAT, _json({"messages": MSG, "logprobs": True,
                                          "top_logprobs": -1}), ""),
    "10,000 stop strings with an empty one": (
        CMPL, _json({"prompt": "hi", "stop": [f"s{i}" for i in range(9_999)] + [""]}), ""),
    "logit_bias huge key": (CMPL, _json({"prompt": "hi", "logit_bias": {"9" * 30: 1}}), ""),
    "logit_bias word key": (CMPL, _json({"prompt": "hi", "logit_bias": {"abc": 1}}), ""),
    "logit_bias NaN value": (CMPL, b'{"prompt": "hi", "logit_bias": {"5": NaN}}', ""),
    "malformed JSON": (CMPL, b'{"prompt": ', ""),
    "JSON nested 100,000 deep": (CMPL, b"[" * 100_000 + b"]" * 100_000, ""),
    "chat JSON nested deep": (CHAT, b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", ""),
    "not JSON at all": (CMPL, b"\xff\xfe\x00garbage", ""),
    "wrong content type": (CMPL, b"prompt=hi&max_tokens=2", "application/x-www-form-urlencoded"),
    "lone surrogate prompt": (CMPL, b'{"prompt": "\\ud800 hi", "max_tokens": 1}', ""),
    "lone surrogate chat": (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', ""),
    "lone surrogate tokenize": ("/tokenize", b'{"prompt": "\\ud800"}', ""),
    "lone surrogate tokenize chat": (
        "/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', ""),
}


@pytest.mark.parametrize("case", list(PAYLOADS))
def test_absurd_payload_is_a_4xx(server: ServerProcess, case: str) -> None:
    """(the 20 MB ones are 413s now; the 4 MB ones reach ``encode_within``)"""
    path, body, content_type = PAYLOADS[case]
    reply = httpx.post(f"{server.url}{path}", content=body, timeout=120,
                       headers={"content-type": content_type or "application/json"})
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text[:500])
    error = reply.json()["error"]
    assert error["message"] and error["type"], error
    # the server is not left busy (n = 10**6 queued nothing) and still serves
    wait_idle(server)
    still_serves(server)


def test_fits_the_context_is_still_served(server: ServerProcess) -> None:
    """The bounds refuse only the absurd: max_tokens up to the context, n up to 128,
    a prompt of many characters per token."""
    limit = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    reply = httpx.post(f"{server.url}{CMPL}", timeout=120, json={
        "prompt": "hi", "max_tokens": limit, "ignore_eos": True,
        "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)], "logit_bias": {"5": 100}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    reply = httpx.post(f"{server.url}{CMPL}", timeout=120,
                       json={"prompt": "hi", "n": 128, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 128
    # a long run of one character: far more characters than tokens
    reply = httpx.post(f"{server.url}{CMPL}", timeout=120,
                       json={"prompt": " " * (limit * 20), "max_tokens": 1})
    assert reply.status_code in (200, 400), reply.text
    wait_idle(server)


@pytest.mark.parametrize("path,body", [
    (CMPL, {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True}),
    (CHAT, {"messages": MSG, "max_tokens": 400, "ignore_eos": True}),
    (CMPL, {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True, "n": 3}),
    (CHAT, {"messages": MSG, "max_tokens": 400, "ignore_eos": True, "n": 3}),
], ids=["completion", "chat", "completion-n3", "chat-n3"])
@pytest.mark.parametrize("when", ["after-first-chunk", "before-any-byte"])
def test_dropped_streams_are_aborted(server: ServerProcess, path: str, body: dict[str, Any],
                                     when: str) -> None:
    """Many clients close their socket mid-stream at once: every request aborts."""
    socks = [raw_request(server, path, _json({**body, "stream": True})) for _ in range(12)]
    if when == "after-first-chunk":
        for sock in socks:
            got = b""
            while b"data:" not in got:
                more = sock.recv(4096)
                assert more, got
                got += more
    for sock in socks:
        sock.close()
    wait_idle(server)
    still_serves(server)


def test_dropped_non_streaming_requests_are_aborted(server: ServerProcess) -> None:
    socks = [raw_request(server, CMPL, _json({"prompt": "hi", "max_tokens": 400,
                                              "ignore_eos": True, "n": 2}))
             for _ in range(8)]
    time.sleep(0.5)  # let them be queued (not a timed assertion: idle either way)
    for sock in socks:
        sock.close()
    wait_idle(server)
    still_serves(server)


def test_slow_readers_do_not_block_others(server: ServerProcess) -> None:
    """Streams nobody reads (their socket buffers fill) while another client is served."""
    slow = []
    try:
        for _ in range(6):
            sock = raw_request(server, CMPL, _json({
                "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "n": 4,
                "stream": True}))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            slow.append(sock)
        deadline = time.monotonic() + IDLE_WAIT_S
        while gauges(server)["running"] < 24:  # all 24 slow choices are in the batch
            assert time.monotonic() < deadline, gauges(server)
            time.sleep(0.1)
        for _ in range(3):
            still_serves(server)
        chat = httpx.post(f"{server.url}{CHAT}", timeout=120,
                          json={"messages": MSG, "max_tokens": 3, "stream": True})
        assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")
    finally:
        for sock in slow:
            sock.close()
    wait_idle(server)


def test_a_body_over_the_bound_is_a_413_unread(server: ServerProcess) -> None:
    """30 MB with its Content-Length is refused from the header; sent chunked
    (no length), once the count crosses the bound; the server serves on."""
    declared = httpx.post(f"{server.url}{CMPL}", timeout=120,
                          json={"prompt": "a" * 30_000_000, "max_tokens": 1})

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"a" * 1_000_000
        yield b'", "max_tokens": 1}'

    chunked = httpx.post(f"{server.url}{CMPL}", content=chunks(), timeout=120,
                         headers={"content-type": "application/json"})
    assert chunked.request.headers.get("transfer-encoding") == "chunked"
    for reply in (declared, chunked):
        assert reply.status_code == 413, reply.text[:500]
        error = reply.json()["error"]
        assert error["type"] == "RequestTooLargeError" and str(MAX_BODY) in error["message"]
    # just under the bound is read and judged on its content (a prompt too long)
    under = httpx.post(f"{server.url}/tokenize", timeout=120,
                       json={"prompt": "a " * (MAX_BODY // 2 - 100)})
    assert under.status_code == 400 and "max_model_len" in under.text, under.text[:500]
    still_serves(server)


def test_tokenize_answers_within_the_context(server: ServerProcess) -> None:
    reply = httpx.post(f"{server.url}/tokenize", timeout=120, json={"prompt": "a " * 300})
    assert reply.status_code == 200 and reply.json()["count"] >= 300, reply.text[:500]


def test_encode_within_tokenizes_a_bounded_prefix_of_a_huge_text() -> None:
    """A 20 MB prompt is refused from its prefix: the tokenizer (which holds the GIL,
    so the server's event loop with it) never sees the whole text."""
    from mpexec.engine.validation import PREFIX_CHARS_PER_TOKEN, RequestError, encode_within

    seen: list[int] = []

    def encode(text: str) -> list[int]:
        seen.append(len(text))
        return list(range(len(text.split())))

    with pytest.raises(RequestError, match="max_model_len"):
        encode_within(encode, "a " * 10_000_000, 512)
    assert seen == [512 * PREFIX_CHARS_PER_TOKEN]
    seen.clear()
    assert encode_within(encode, "a " * 100, 512) == list(range(100))
    assert seen == [200]
