"""Structured output: an automaton per request that says which tokens may come next.

::

    GuidedDecodingParams(json= | regex= | choice=)
      │ json: outlines_core.json_schema.build_regex_from_schema; choice: an alternation
      ▼
    regex ── outlines_core.Index(regex, Vocabulary(eos, token bytes -> ids))
      │        (compiled once per regex and kept, the last COMPILED_KEPT of them:
      │         the costly part, done in a child process, see below)
      ▼
    Guide(index) per request ── write_mask_into ─► one int32 bitmask row per step
      ▲                                             (GrammarOutput, sent with sample_tokens)
      └── advance(token) as each sampled token comes back

The vocabulary is the checkpoint's tokenizer as bytes: byte-level BPE tokens
map back through the GPT-2 byte alphabet, SentencePiece pieces through
``▁`` → space and ``<0xNN>``; special tokens are left out (only EOS ends a
constrained output, once the automaton accepts).  The bitmask is as wide as
the model's vocabulary (which may be padded past the tokenizer's).
A request with a constraint never runs on a placeholder (the scheduler
waits for its token before scheduling it again), so async scheduling
overlaps only the unconstrained requests.

Compiling can take far longer than anything else a request costs, and
grows exponentially in innocent-looking specs: ``{"type": "string",
"maxLength": 16}`` takes seconds, ``"maxLength": 20`` minutes and
gigabytes (the automaton follows every UTF-8 byte of a negated character
class through each optional repeat).  The engine thread compiles, so the
whole batch would wait for it and no thread can be stopped midway; the
automaton is therefore built in a child process (the ``forkserver``
context, so nothing of this threaded process is copied)::

    engine thread                                 child
      Process(_compile_child, regex, vocabulary) ──► setrlimit(RLIMIT_AS, now +
      wait up to COMPILE_TIMEOUT_S on the pipe           COMPILE_MEMORY_BYTES)
                                                     Index(regex, Vocabulary)
      ◄── ("ok", pickled Index) | ("error", text) ─── send, exit
      nothing in time: kill, join, ValueError naming the bound

so a constraint that does not compile within the bounds is a ``ValueError``
for its request (a 400 from the server).  ``AsyncLLM`` (the server) compiles
on a thread of its own (``admission.RequestBuilder``), so the batch does not
wait for it; ``LLM`` compiles as it adds the request, at most
``COMPILE_TIMEOUT_S``.  ``guide`` is safe from several threads (the compiled
automata are kept under a lock; two threads that miss on one regex at once
both compile it), and ``cancel_compiles`` ends every compile in flight, and
refuses later ones, within ``_CANCEL_POLL_S``.

``outlines-core`` is optional (``pip install 'mpexec[serve]'``).
"""

from __future__ import annotations

import array
import json
import multiprocessing
import pickle
import re
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from mpexec.outputs import GrammarOutput, GuidedDecodingParams

INSTALL_HINT = "structured output needs outlines-core: pip install 'mpexec[serve]'"
COMPILE_TIMEOUT_S = 30.0  # how long one constraint may take to compile
COMPILE_MEMORY_BYTES = 4 << 30  # address space the compiling child may add
COMPILED_KEPT = 64  # compiled automata kept for reuse (least recently used go)
_CANCEL_POLL_S = 0.1  # how often a compile in flight looks at cancel_compiles


def _outlines() -> Any:
    try:
        import outlines_core
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return outlines_core


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte → printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def vocabulary_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Token id → the bytes it stands for, special tokens left out.

    ``tokenizer`` is a :class:`mpexec.models.tokenizer.Tokenizer` (its
    ``backend`` is a ``tokenizers.Tokenizer``).
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise ValueError("structured output needs the checkpoint's tokenizer "
                         f"(a tokenizers backend); {type(tokenizer).__name__} has none")
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    byte_level = "ByteLevel" in repr(backend.decoder)
    table = _byte_decoder()
    out: dict[int, bytes] = {}
    for text, token in backend.get_vocab(with_added_tokens=True).items():
        if token in special:
            continue
        if byte_level and all(c in table for c in text):
            out[token] = bytes(table[c] for c in text)
        elif (match := _BYTE_PIECE.match(text)) is not None:
            out[token] = bytes([int(match.group(1), 16)])
        else:
            out[token] = text.replace("▁", " ").encode()
    return out


def guide_regex(params: GuidedDecodingParams) -> str:
    """The regular expression a constraint compiles to."""
    if params.regex is not None:
        return params.regex
    if params.choice is not None:
        return "(" + "|".join(re.escape(c) for c in params.choice) + ")"
    schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
    try:
        return str(_outlines().json_schema.build_regex_from_schema(
            schema, params.whitespace_pattern))
    except ImportError:
        raise
    except Exception as exc:  # the library raises its own error types
        raise ValueError(f"guided_decoding.json is not a usable JSON schema: {exc}") from None


def guided_from_response_format(response_format: Any) -> GuidedDecodingParams | None:
    """OpenAI's ``response_format`` as a constraint: ``{"type": "json_schema",
    "json_schema": {"schema": ...}}`` → that schema, ``{"type": "json_object"}``
    → any JSON object, ``{"type": "text"}`` or None → no constraint."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json={"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema (an object)")
        return GuidedDecodingParams(json=schema)
    raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'; "
                     f"got {kind!r}")


class StructuredOutputs:
    """Compiles constraints over one tokenizer's vocabulary and builds the bitmasks."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        oc = _outlines()
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        by_bytes: dict[bytes, list[int]] = {}
        for token, data in vocabulary_bytes(tokenizer).items():
            if token < vocab_size and token != eos_token_id:
                by_bytes.setdefault(data, []).append(token)
        self.vocabulary = oc.Vocabulary(eos_token_id, by_bytes)
        self._eos_token_id = eos_token_id
        self._by_bytes = by_bytes
        self._indexes: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self.compile_timeout_s = COMPILE_TIMEOUT_S
        self.compile_memory_bytes = COMPILE_MEMORY_BYTES

    def guide(self, params: GuidedDecodingParams) -> Any:
        """A fresh automaton for one request (ValueError: a bad regex or schema, or
        one that does not compile within the time and memory bounds)."""
        oc = _outlines()
        regex = guide_regex(params)
        with self._lock:
            index = self._indexes.get(regex)
        if index is None:
            index = self._compile(regex)
        with self._lock:
            self._indexes[regex] = index
            self._indexes.move_to_end(regex)
            while len(self._indexes) > COMPILED_KEPT:
                self._indexes.popitem(last=False)
        return oc.Guide(index)

    def cancel_compiles(self) -> None:
        """End every compile in flight (``ValueError``) and refuse later ones."""
        self._cancelled.set()

    def _compile(self, regex: str) -> Any:
        if self._cancelled.is_set():
            raise ValueError("guided_decoding: the engine is shutting down")
        context = multiprocessing.get_context("forkserver")
        receive, send = context.Pipe(duplex=False)
        child = context.Process(
            target=_compile_child, name="mpexec-grammar-compile", daemon=True,
            args=(regex, self._eos_token_id, self._by_bytes, self.compile_memory_bytes, send))
        child.start()
        send.close()
        deadline = time.monotonic() + self.compile_timeout_s
        try:
            reply = None
            while not self._cancelled.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if receive.poll(min(left, _CANCEL_POLL_S)):
                    reply = receive.recv()
                    break
        except EOFError:  # the child died (out of its memory bound, say)
            reply = ("error", f"the compiler died (exit code {child.exitcode}, "
                              f"{self.compile_memory_bytes >> 20} MiB bound)")
        finally:
            receive.close()
            if child.is_alive():
                child.kill()
            child.join(5.0)
        if reply is None and self._cancelled.is_set():
            raise ValueError("guided_decoding: the engine is shutting down")
        if reply is None:
            raise ValueError(f"guided_decoding: {regex[:200]!r} did not compile within "
                             f"{self.compile_timeout_s:g} s (its automaton grows too large; "
                             "a long bounded repeat, such as a JSON string's maxLength, "
                             "does that)")
        kind, payload = reply
        if kind != "ok":
            raise ValueError(f"guided_decoding: cannot compile {regex[:200]!r} over the "
                             f"vocabulary: {payload}")
        return pickle.loads(payload)

    def grammar_output(self, req_ids: Sequence[str], guides: Sequence[Any]) -> GrammarOutput:
        """One bitmask row per request, in order (int32 words, bit set = allowed)."""
        mask = array.array("i", bytes(4 * self.words * len(guides)))
        address, _ = mask.buffer_info()
        for row, guide in enumerate(guides):
            guide.write_mask_into(address + 4 * self.words * row, self.words, 4)
        return GrammarOutput(structured_output_request_ids=list(req_ids),
                             grammar_bitmask=mask)


def _compile_child(regex: str, eos_token_id: int, by_bytes: dict[bytes, list[int]],
                   memory_bytes: int, reply: Any) -> None:
    """In the child: compile under a memory bound, send the pickled index or the error."""
    try:
        with open("/proc/self/status") as status:
            now = next(int(line.split()[1]) * 1024 for line in status
                       if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (now + memory_bytes, now + memory_bytes))
    except (OSError, ValueError, StopIteration):
        pass  # no /proc or no limit to set: the time bound still holds
    try:
        oc = _outlines()
        index = oc.Index(regex, oc.Vocabulary(eos_token_id, by_bytes))
        reply.send(("ok", pickle.dumps(index)))
    except BaseException as exc:  # the library raises its own types; MemoryError too
        reply.send(("error", f"{type(exc).__name__}: {str(exc)[:500]}"))
