"""``AsyncLLM``: the engine loop on its own thread, fed by an asyncio front end.

::

    asyncio side (any number of tasks)         engine thread (one)
    ──────────────────────────────────         ───────────────────────────────
    add_request(prompt, params)                loop:
      prepare_prompt / check_params  (raise)     apply commands (add, abort)
      commands.append(add) ── wake ────────►     nothing to run? sleep on `wake`
    async for out in stream:                      Engine.step()   (the executor's
      await stream's event  ◄── call_soon ──      publish: one call_soon_threadsafe
                                 threadsafe        per step, each stream's latest
    abort(request_id) ── commands ────────►       output (text decoded
                                                   incrementally, StreamText)

The engine (scheduler, block manager) is touched by the engine thread only:
the front end talks to it through a command deque and a wake event, so a
request joins or leaves the running batch between two steps, and an idle
engine sleeps on the event (no polling).  Outputs are cumulative (the text
and token ids so far): a consumer that falls behind gets the latest one, and
the final output (``finished``) always arrives.

Failure: when a step raises (a worker died: ``WorkerDiedError``; a worker
error the engine cannot keep apart from the rest) every open stream raises
that error, later requests get ``EngineDeadError`` and ``is_healthy`` turns
False; a worker that dies while the engine is idle wakes the loop through
the executor's failure callback and does the same.  A step the workers
refused because of one request's input fails that request alone
(``Engine.step``); the loop goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from mpexec.engine.engine import Engine, EngineDeadError
from mpexec.engine.llm import LLM, PromptType
from mpexec.engine.outputs import RequestOutput
from mpexec.engine.request import Request
from mpexec.engine.stream_text import StreamText
from mpexec.engine.validation import check_params, prepare_prompt
from mpexec.outputs import SamplingParams

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0
COMPILE_THREADS = 2  # constraints compiled at once (each in a child of its own)


@dataclass
class _Add:
    stream: RequestStream
    token_ids: list[int]
    params: SamplingParams
    grammar: Any = None  # its constraint's automaton, compiled off the engine thread
    error: BaseException | None = None  # the constraint did not compile


@dataclass
class _Abort:
    req_id: str | None  # None: every request


@dataclass
class _Tracked:
    stream: RequestStream
    request: Request
    text: StreamText
    seen: tuple[int, bool] = (0, False)


class RequestStream:
    """One request's outputs, as an async iterator (``async for out in stream``).

    Created (and checked) by :meth:`AsyncLLM.add_request`; iterating it yields
    cumulative :class:`RequestOutput` objects, the last with ``finished``, or
    raises the error the request failed with.  Leaving the loop early (a
    ``break``, a cancelled task) aborts the request.
    """

    def __init__(self, owner: AsyncLLM, req_id: str, prompt: str | None,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = req_id
        self.prompt = prompt
        self.num_prompt_tokens = 0
        self.arrival = time.monotonic()
        self._owner = owner
        self._loop = loop
        self._event = asyncio.Event()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self.finished = False

    # called on the event loop (call_soon_threadsafe from the engine thread)
    def _deliver(self, output: RequestOutput | None, error: BaseException | None) -> None:
        if error is not None:
            self._error = error
        if output is not None:
            self._latest = output
        self._event.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                await self._event.wait()
                self._event.clear()
                if self._error is not None:
                    self.finished = True
                    raise self._error
                output, self._latest = self._latest, None
                if output is None:
                    continue
                if output.finished:
                    self.finished = True
                yield output
                if self.finished:
                    return
        finally:
            if not self.finished:
                self._owner.abort(self.request_id)


class AsyncLLM:
    """A model on N workers for asyncio servers: many concurrent streaming requests.

    ``AsyncLLM(model, **llm_options)`` takes the options of :class:`LLM`
    (which starts the workers and the engine); ``AsyncLLM(llm=an_llm)`` takes
    over one already started (its blocking methods must not be used after).
    """

    def __init__(self, model: str = "default", *, llm: LLM | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 **llm_options: Any) -> None:
        self._llm = llm if llm is not None else LLM(model, **llm_options)
        self.engine: Engine = self._llm.engine
        self.tokenizer = self._llm.tokenizer
        self.vocab_size = self._llm.vocab_size
        self.max_model_len = self.engine.limits.max_model_len
        self.error: BaseException | None = None
        self.on_failure = on_failure
        # Counters for metrics (written by the engine thread, read anywhere).
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_requests_finished = 0
        self._ids = itertools.count()
        self._commands: deque[_Add | _Abort] = deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        # constrained requests whose automaton is being compiled, and those of
        # them aborted meanwhile (aborted as soon as they are added)
        self._compiler = ThreadPoolExecutor(COMPILE_THREADS,
                                            thread_name_prefix="mpexec-grammar")
        self._compiling: set[str] = set()
        self._abort_on_arrival: set[str] = set()
        self._shutdown_done = False
        self.engine.add_dead_listener(self._wake.set)
        self._thread = threading.Thread(target=self._run, name="mpexec-engine", daemon=True)
        self._thread.start()

    # -- front end (event loop) ------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.error is None and not self.engine.is_dead and self._thread.is_alive()

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> RequestStream:
        """Check the request and queue it; a ``ValueError`` (naming the field) at once
        when it could never run, ``EngineDeadError`` when the engine has failed."""
        self._raise_if_failed()
        params = check_params(params if params is not None else SamplingParams())
        text, ids = prepare_prompt(prompt, self.tokenizer.encode, self.vocab_size,
                                   self.max_model_len)
        req_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        stream = RequestStream(self, req_id, text, asyncio.get_running_loop())
        stream.num_prompt_tokens = len(ids)
        if params.guided_decoding is None:
            self._commands.append(_Add(stream, ids, params))
            self._wake.set()
            return stream
        # compiling may take seconds: the engine thread goes on stepping meanwhile
        self._compiling.add(req_id)
        try:
            compiling = self._compiler.submit(self.engine.builder.compile_guide,
                                              params.guided_decoding)
        except RuntimeError:  # the pool is shut down: so is the engine, a moment later
            self._compiling.discard(req_id)
            raise EngineDeadError("the engine is shutting down") from None
        compiling.add_done_callback(lambda done: self._compiled(_Add(stream, ids, params), done))
        return stream

    def _compiled(self, command: _Add, done: Future[Any]) -> None:
        """(a compile thread) The constraint is compiled, or failed: queue the request."""
        try:
            command.grammar = done.result()
        except CancelledError:  # shutdown: it never started
            command.error = EngineDeadError("the engine shut down before the request's "
                                            "constraint compiled")
        except BaseException as exc:  # ValueError (at shutdown too: cancel_compiles)
            command.error = exc
        self._commands.append(command)
        self._wake.set()

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Partial outputs of one request as its tokens arrive; the last has ``finished``."""
        stream = self.add_request(prompt, params, request_id)
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """Finish the request (``"abort"``) at the next step; its KV blocks come back."""
        self._commands.append(_Abort(request_id))
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every open request at the next step (a server's grace period is over)."""
        self._commands.append(_Abort(None))
        self._wake.set()

    def _raise_if_failed(self) -> None:
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shutting down")
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error}") from self.error
        if self.engine.is_dead:
            raise EngineDeadError("the engine failed: its executor reported a worker failure")

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                self._apply_commands()
                if self.engine.is_dead:
                    # failed through the executor's callback: its first
                    # error (which worker, how) is the streams' error
                    self._fail(self.engine.error or self.engine.executor.failure or
                               EngineDeadError("the engine failed: its executor "
                                               "reported a worker failure"))
                    return
                if not self.engine.has_unfinished_requests():
                    self._publish()  # aborted requests end here
                    self._wake.wait()
                    continue
                try:
                    self.engine.step()
                except BaseException as exc:
                    self._fail(exc)
                    return
                self._publish()
        except BaseException as exc:  # a bug here must not leave streams waiting
            logger.exception("the engine loop failed")
            self._fail(exc)
        finally:
            self._close_streams()

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Abort):
                ids = [command.req_id] if command.req_id is not None else list(self._tracked)
                compiling = [command.req_id] if command.req_id is not None \
                    else list(self._compiling)
                self._abort_on_arrival.update(i for i in compiling if i in self._compiling)
                for req_id in ids:
                    self.engine.abort_request(req_id)
                continue
            stream = command.stream
            self._compiling.discard(stream.request_id)
            aborted = stream.request_id in self._abort_on_arrival
            self._abort_on_arrival.discard(stream.request_id)
            try:
                if command.error is not None:
                    raise command.error
                request = self.engine.add_request(command.token_ids, command.params,
                                                  stream.request_id, grammar=command.grammar)
            except BaseException as exc:
                self._send(stream, None, exc)
                continue
            request.arrival_time = stream.arrival
            self.num_prompt_tokens += len(command.token_ids)
            text = StreamText(self.tokenizer, command.params.skip_special_tokens)
            self._tracked[stream.request_id] = _Tracked(stream, request, text)
            if aborted:  # while its constraint compiled
                self.engine.abort_request(stream.request_id)

    def _publish(self) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        done = []
        for req_id, item in self._tracked.items():
            request = item.request
            state = (len(request.output_token_ids), request.is_finished)
            if state == item.seen:
                continue
            self.num_generation_tokens += state[0] - item.seen[0]
            item.seen = state
            if request.is_finished:
                done.append(req_id)
                self.num_requests_finished += 1
            if request.error is not None:
                batches.setdefault(item.stream._loop, []).append(
                    (item.stream, None, _own_copy(request.error)))
                continue
            text = item.text.update(request.output_token_ids, request.is_finished)
            output = self._llm._output(request, item.stream.prompt, text)
            batches.setdefault(item.stream._loop, []).append((item.stream, output, None))
        for req_id in done:
            del self._tracked[req_id]
        for loop, batch in batches.items():
            _call_soon(loop, _deliver_all, batch)

    def _send(self, stream: RequestStream, output: RequestOutput | None,
              error: BaseException | None) -> None:
        _call_soon(stream._loop, _deliver_all, [(stream, output, error)])

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            logger.error("the engine failed: %s: %s", type(exc).__name__,
                         str(exc).splitlines()[0] if str(exc) else "")
        if self.on_failure is not None:  # before the streams hear of it
            try:
                self.on_failure(exc)
            except Exception:
                logger.exception("the on_failure callback raised")
        for item in self._tracked.values():
            self._send(item.stream, None, _own_copy(exc))
        self._tracked.clear()
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                self._send(command.stream, None, _own_copy(exc))

    def _close_streams(self) -> None:
        """Shutdown: whatever is still open ends with ``EngineDeadError``."""
        closing = EngineDeadError("the engine shut down before the request finished")
        for item in self._tracked.values():
            self._send(item.stream, None, _own_copy(closing))
        self._tracked.clear()
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                self._send(command.stream, None, _own_copy(closing))

    # -- introspection -----------------------------------------------------------------

    def load(self) -> dict[str, float]:
        """Requests running and waiting, KV-cache use (0..1): read racily, for metrics."""
        scheduler = self.engine.scheduler
        total = max(1, self.engine.num_blocks)
        return {"running": float(len(scheduler.running)),
                "waiting": float(len(scheduler.waiting)),
                "kv_cache_usage": 1.0 - scheduler.blocks.num_free_blocks / total}

    # -- end -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the loop (open requests end with ``EngineDeadError``), then the workers."""
        if self._shutdown_done:
            return
        self._shutdown_done = True
        # compiles first, each ending within a poll: every request they held is
        # in the command queue before the loop stops (and ends its stream)
        self.engine.builder.cancel_compiles()
        self._compiler.shutdown(wait=True, cancel_futures=True)
        self._stopping.set()
        self._wake.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", JOIN_TIMEOUT_S)
        self._llm.shutdown()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def _deliver_all(batch: list[tuple[RequestStream, RequestOutput | None,
                                   BaseException | None]]) -> None:
    for stream, output, error in batch:
        stream._deliver(output, error)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None],
               *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _own_copy(exc: BaseException) -> BaseException:
    """One exception instance per stream (each is raised in its own task)."""
    cls = type(exc)
    try:
        clone = cls.__new__(cls, *exc.args)
        clone.args = exc.args
        clone.__dict__.update(exc.__dict__)
    except Exception:
        return exc
    clone.__cause__ = exc.__cause__
    clone.__traceback__ = exc.__traceback__
    return clone
