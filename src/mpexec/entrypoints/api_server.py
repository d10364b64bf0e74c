"""The FastAPI app: the OpenAI endpoints over one :class:`AsyncLLM`.

=========================  ================================================================
endpoint                   answers
=========================  ================================================================
POST /v1/completions       text for each prompt (``n`` choices each); ``stream: true``:
                           server-sent events, ``text_completion`` chunks, ``[DONE]``
POST /v1/chat/completions  a reply through the checkpoint's chat template; streamed as
                           ``chat.completion.chunk`` events (the first carries the role)
GET  /v1/models            the served model name(s)
POST /tokenize             ``{"prompt"}`` or ``{"messages"}`` → ``{"tokens", "count"}``
POST /detokenize           ``{"tokens"}`` → ``{"prompt"}``
GET  /health               200, or 503 once the engine has failed
GET  /metrics              Prometheus text (see ``metrics``)
=========================  ================================================================

A request body over ``max_body_bytes`` (``serve --max-request-bytes``, 8 MiB
by default) is a 413 before it is read in full. A request is checked in full
before anything is queued: malformed (or too deeply nested) JSON, an unknown
model, text that is not valid Unicode (a lone surrogate), a prompt longer than
the context, ``max_tokens`` above the whole context, ``n`` above ``MAX_N`` or
more than ``MAX_CHOICES`` choices in all, more than ``MAX_STOP_STRINGS`` stop
strings or ``MAX_STOP_CHARS`` characters of them (each costs every step of the
batch), or a bad sampling value is a 400 in the OpenAI error shape, and the
server serves on. A text far longer than the context is refused from a prefix
of it (``encode_within``), so that a 20 MB prompt (to ``/tokenize`` too) does
not hold the event loop while the tokenizer runs. With an API key, every path
but ``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY`` (401
otherwise). An engine failure ends every open request with a 500 (an ``error``
event in a stream that has started). A client that disconnects mid-stream
cancels its response, which aborts its request; a non-streaming request checks
for its client every second and aborts the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from mpexec.engine.async_llm import AsyncLLM, RequestStream
from mpexec.engine.engine import EngineDeadError
from mpexec.engine.outputs import RequestOutput
from mpexec.engine.validation import check_token_ids, encode_within
from mpexec.entrypoints.metrics import ServerMetrics, observe_tokens
from mpexec.entrypoints.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
    completion_prompts,
    for_choice,
    parse,
    sampling_params,
)
from mpexec.outputs import SamplingParams

OPEN_PATHS = ("/health", "/metrics")
MAX_BODY_BYTES = 8 * 1024 * 1024  # default request body bound (``serve --max-request-bytes``)
DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks for its client
MAX_N = 128  # choices per prompt (OpenAI's own bound)
MAX_CHOICES = 2048  # prompts x n in one request: each is a request in the engine


class Server:
    """What the endpoints share: the engine, the model names, the metrics."""

    def __init__(self, engine: AsyncLLM, model_names: Sequence[str],
                 api_key: str | None = None) -> None:
        self.engine = engine
        self.model_names = list(model_names)
        self.api_key = api_key
        self.metrics = ServerMetrics(engine, self.model_names[0])
        self.created = int(time.time())

    # -- checks -------------------------------------------------------------------------

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.model_names:
            return requested or self.model_names[0]
        raise ApiError(f"the model '{requested}' does not exist; this server serves "
                       f"{', '.join(repr(n) for n in self.model_names)}", 400,
                       "NotFoundError", "model_not_found")

    def open_streams(self, prompts: Sequence[Any], params: SamplingParams, n: int,
                     request_id: str) -> list[RequestStream]:
        """One stream per prompt and choice, all checked first; index = prompt * n + choice."""
        if not isinstance(n, int) or n < 1 or n > MAX_N:
            raise ApiError(f"n: must be an integer >= 1 and <= {MAX_N}; got {n!r}")
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(f"the request asks for {len(prompts)} prompts x n={n} choices; "
                           f"this server takes at most {MAX_CHOICES} in one request")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    streams.append(self.engine.add_request(
                        prompt, for_choice(params, j), f"{request_id}-{i}-{j}"))
        except BaseException as exc:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise _as_api_error(exc) from None
        return streams

    # -- bodies -------------------------------------------------------------------------

    def logprobs(self, output: RequestOutput, start: int, chat: bool) -> Any:
        completion = output.outputs[0]
        entries = completion.logprobs
        if entries is None:
            return None
        ids = completion.token_ids[start:]
        rows = [(self._token_text(t), *_logprob_of(t, e, self._token_text))
                for t, e in zip(ids, entries[start:], strict=False)]
        if chat:
            return {"content": [
                {"token": text, "logprob": lp, "bytes": list(text.encode()),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                  for t, v in top]}
                for text, lp, top in rows]}
        return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [dict(r[2]) if r[2] else None for r in rows],
                "text_offset": []}

    def max_tokens(self, given: int | None) -> int | None:
        """``max_tokens`` as given; a 400 when it exceeds the whole context (like OpenAI's)."""
        limit = self.engine.max_model_len
        if isinstance(given, int) and limit is not None and given > limit:
            raise ApiError(f"max_tokens: {given} is more than the context holds "
                           f"({limit} tokens, max_model_len, prompt and output together)")
        return given

    def chat_ids(self, messages: Any, add_generation_prompt: bool) -> list[int]:
        """The token ids of a conversation through the chat template; a 400 if it fails.

        A tokenizer that renders the template to text (``chat_prompt``, as
        mpexec's own does) has the text checked for Unicode and encoded by
        ``encode_within``; any other is asked for the ids directly."""
        tokenizer: Any = self.engine.tokenizer
        render = getattr(tokenizer, "chat_prompt", None)
        try:
            if render is None:
                return list(tokenizer.apply_chat_template(
                    chat_messages(messages), add_generation_prompt=add_generation_prompt))
            text = render(chat_messages(messages), add_generation_prompt=add_generation_prompt)
        except ApiError:
            raise
        except Exception as exc:  # the template raised (a role it does not know, say)
            raise ApiError(f"messages: the chat template failed: {exc}") from None
        _check_unicode(text, "messages")
        try:
            return encode_within(lambda t: list(tokenizer.encode(t, add_special_tokens=False)),
                                 text, self.engine.max_model_len)
        except ValueError as exc:  # far longer than the context
            raise ApiError(str(exc)) from None

    def _token_text(self, token_id: int) -> str:
        return str(self.engine.tokenizer.decode([token_id], skip_special_tokens=False))


def _logprob_of(token_id: int, entry: Any,
                text: Callable[[int], str]) -> tuple[float, list[tuple[str, float]]]:
    """One position's logprob and top alternatives, whatever the engine's form of it."""
    def value(v: Any) -> float:
        return float(getattr(v, "logprob", v))

    if isinstance(entry, dict):
        top = [(text(int(k)), value(v)) for k, v in entry.items()]
        return (value(entry[token_id]) if token_id in entry else -math.inf), top
    return value(entry), []


def _as_api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ApiError(f"the engine is not serving: {str(exc).splitlines()[0]}", 503,
                        "ServiceUnavailableError")
    if isinstance(exc, (ValueError, TypeError)):
        return ApiError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return exc


def _check_unicode(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, from JSON's "\ud800"
        raise ApiError(f"{field}: not valid Unicode (character {exc.start}: "
                       f"{text[exc.start]!r})") from None


def _engine_error(exc: BaseException) -> ApiError:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return ApiError(f"the engine failed: {type(exc).__name__}: {first}", 500,
                    "InternalServerError")


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"malformed JSON in the request body: {exc}") from None
    except RecursionError:
        raise ApiError("the request body's JSON is nested too deeply") from None


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """``(index, output)`` from every stream as they come; an exception is yielded too."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        except Exception as exc:
            yield 0, exc
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_count = len(streams)
        while open_count:
            index, item = await queue.get()
            if item is None:
                open_count -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


class _Tracker:
    """Per choice: the text and tokens already sent, and the token timings."""

    def __init__(self, streams: list[RequestStream], metrics: ServerMetrics) -> None:
        self.streams = streams
        self.metrics = metrics
        self.text = [""] * len(streams)
        self.tokens = [0] * len(streams)
        self.last: list[float | None] = [None] * len(streams)
        self.final: list[RequestOutput | None] = [None] * len(streams)

    def update(self, index: int, output: RequestOutput) -> tuple[str, int]:
        """The new text, and where the new tokens start."""
        now = time.monotonic()
        count = len(output.token_ids)
        observe_tokens(self.metrics, self.streams[index].arrival, self.last[index], now,
                       count - self.tokens[index])
        if count > self.tokens[index]:
            self.last[index] = now
        start, self.tokens[index] = self.tokens[index], count
        delta = output.text[len(self.text[index]):]
        self.text[index] = output.text
        if output.finished:
            self.final[index] = output
            self.metrics.requests.labels(output.finish_reason or "unknown").inc()
        return delta, start


def build_app(engine: AsyncLLM, model_names: Sequence[str], api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    server = Server(engine, model_names, api_key)
    app = FastAPI(title="mpexec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:  # added last, so it runs first: no key, no body read
        app.add_middleware(_ApiKeyCheck, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return JSONResponse(ApiError("the engine has failed", 503,
                                     "ServiceUnavailableError").body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": server.created, "owned_by": "mpexec",
             "root": name, "max_model_len": engine.max_model_len}
            for name in server.model_names]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse(TokenizeRequest, await _body(request))
        server.model_name(body.model)
        if body.messages is not None:
            ids = server.chat_ids(body.messages, body.add_generation_prompt)
        elif body.prompt is not None:
            _check_unicode(body.prompt, "prompt")
            try:
                ids = encode_within(lambda t: list(engine.tokenizer.encode(t)), body.prompt,
                                    engine.max_model_len)
            except ValueError as exc:  # far longer than the context
                raise ApiError(str(exc)) from None
        else:
            raise ApiError("give 'prompt' or 'messages'")
        return {"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse(DetokenizeRequest, await _body(request))
        server.model_name(body.model)
        try:
            ids = check_token_ids(body.tokens, engine.vocab_size, field_name="tokens")
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        return {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await _body(request))
        name = server.model_name(body.model)
        if body.echo or body.suffix:
            raise ApiError("echo and suffix are not supported by this server")
        max_tokens = server.max_tokens(body.max_tokens)
        params = sampling_params(body, max_tokens if max_tokens is not None else 16,
                                 body.logprobs)
        prompts = completion_prompts(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = server.open_streams(prompts, params, body.n, request_id)
        return await _answer(request, server, streams, request_id, name, body, COMPLETION)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatRequest, await _body(request))
        name = server.model_name(body.model)
        ids = server.chat_ids(body.messages, body.add_generation_prompt)
        max_tokens = server.max_tokens(body.max_completion_tokens or body.max_tokens)
        if max_tokens is None:  # OpenAI's default: as much as the context holds
            max_tokens = max(1, engine.max_model_len - len(ids))
        logprobs: int | bool | None = None
        if body.logprobs:
            logprobs = body.top_logprobs or True
        params = sampling_params(body, max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = server.open_streams([{"prompt_token_ids": ids}], params, body.n, request_id)
        return await _answer(request, server, streams, request_id, name, body, CHAT)

    return app


class _ApiKeyCheck:
    """ASGI middleware: 401 for a request without ``Authorization: Bearer KEY``.

    Plain ASGI rather than ``@app.middleware("http")``: that wrapper runs the
    response in a task group of its own, which turns a cancelled stream
    into a logged traceback.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        error = ApiError("a valid API key is needed: Authorization: Bearer KEY", 401,
                         "AuthenticationError", "invalid_api_key")
        await JSONResponse(error.body(), status_code=401)(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413, unread.

    A ``Content-Length`` above the bound is refused before any of the body
    is read; a body without one (chunked) is counted as it arrives, and the
    chunk that crosses the bound raises the 413 from inside ``request.body()``,
    so at most ``max_bytes`` plus one chunk is ever held.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> ApiError:
        return ApiError(f"the request body is {size} bytes; this server takes at most "
                        f"{self.max_bytes} (serve --max-request-bytes)", 413,
                        "RequestTooLargeError")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:  # uvicorn checks the form
            error = self.too_large(declared.decode()[:24])
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self.too_large(f"more than {self.max_bytes}")
            return message

        await self.app(scope, counted, send)


async def _collect(server: Server, streams: list[RequestStream]) -> _Tracker:
    tracker = _Tracker(streams, server.metrics)
    async for index, item in _merged(streams):
        if isinstance(item, BaseException):
            for stream in streams:
                server.engine.abort(stream.request_id)
            raise _engine_error(item) if not isinstance(item, (ValueError, TypeError)) \
                else ApiError(str(item).splitlines()[0])
        tracker.update(index, item)
    return tracker


async def _collect_unless_gone(request: Request, server: Server,
                               streams: list[RequestStream]) -> _Tracker:
    """``_collect``, cancelled (so its requests abort) if the client goes away meanwhile."""
    task = asyncio.ensure_future(_collect(server, streams))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ApiError("the client went away", 499, "ClientClosedRequest")
    finally:
        task.cancel()


def _usage(streams: list[RequestStream], tracker: _Tracker, n: int) -> dict[str, int]:
    prompt = sum(s.num_prompt_tokens for s in streams[::n])
    completion = sum(tracker.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class _Shape:
    """What tells a completion's JSON from a chat completion's; the rest is one path."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.reply_object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def reply_choice(self, index: int, output: RequestOutput, logprobs: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": output.text}
        else:
            choice["text"] = output.text
        choice.update(logprobs=logprobs, finish_reason=output.finish_reason,
                      stop_reason=getattr(output.outputs[0], "stop_reason", None))
        return choice

    def opening_choices(self, count: int) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant's role."""
        if not self.chat:
            return []
        return [{"index": index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None} for index in range(count)]

    def chunk_choice(self, index: int, delta: str, output: RequestOutput,
                     logprobs: Any) -> dict[str, Any]:
        finish = output.finish_reason if output.finished else None
        if self.chat:
            return {"index": index, "delta": {"content": delta} if delta else {},
                    "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": getattr(output.outputs[0], "stop_reason", None)}


COMPLETION = _Shape(chat=False)
CHAT = _Shape(chat=True)


async def _answer(request: Request, server: Server, streams: list[RequestStream],
                  request_id: str, model: str, body: Any, shape: _Shape) -> Response:
    """The reply to an opened request: server-sent events, or one JSON body at the end."""
    if body.stream:
        return StreamingResponse(
            _events(server, streams, request_id, model, body.include_usage, body.n, shape),
            media_type="text/event-stream")
    tracker = await _collect_unless_gone(request, server, streams)
    choices = []
    for index, output in enumerate(tracker.final):
        assert output is not None
        choices.append(shape.reply_choice(index, output,
                                          server.logprobs(output, 0, chat=shape.chat)))
    return JSONResponse({"id": request_id, "object": shape.reply_object,
                         "created": int(time.time()), "model": model, "choices": choices,
                         "usage": _usage(streams, tracker, body.n)})


async def _events(server: Server, streams: list[RequestStream], request_id: str, model: str,
                  include_usage: bool, n: int, shape: _Shape) -> AsyncIterator[str]:
    tracker = _Tracker(streams, server.metrics)
    # Every chunk of a stream starts alike: that part is serialised once.
    head = json.dumps({"id": request_id, "object": shape.chunk_object,
                       "created": int(time.time()), "model": model},
                      ensure_ascii=False)[:-1]

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        tail = f', "usage": {json.dumps(usage)}' if usage is not None else ""
        return f"data: {head}, \"choices\": {json.dumps(choices, ensure_ascii=False)}{tail}}}\n\n"

    for choice in shape.opening_choices(len(streams)):
        yield chunk([choice])
    async for index, item in _merged(streams):
        if isinstance(item, BaseException):
            yield _sse(_engine_error(item).body())
            break
        delta, start = tracker.update(index, item)
        if not delta and not item.finished:
            continue
        yield chunk([shape.chunk_choice(index, delta, item,
                                        server.logprobs(item, start, chat=shape.chat))])
    else:
        if include_usage:
            yield chunk([], _usage(streams, tracker, n))
    yield "data: [DONE]\n\n"
