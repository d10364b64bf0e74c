"""Front-end checks: a request is refused before it reaches the scheduler.

``LLM``, ``AsyncLLM`` and the HTTP server run every prompt and every
``SamplingParams`` through here, so a bad request fails alone, with one line
naming the field, and never reaches a worker (where an error would end the
step of every other request in the batch)::

    prompt ──> prepare_prompt ──> (text, token ids)      ValueError / TypeError
    params ──> check_params   ──> SamplingParams         TypeError

A text prompt far longer than the context is refused from a prefix of it
(``encode_within``): the tokenizer holds the GIL while it runs, so a 20 MB
prompt tokenized in full would stall an asyncio server's event loop for tens
of seconds before the length check refused it.

``RequestError`` is a ``ValueError``: callers that already treat a
``ValueError`` as the user's mistake (the command line's exit status 2, the
server's 400) keep doing so.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

from mpexec.outputs import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses: the message names the field and the rule."""


class RequestTypeError(RequestError, TypeError):
    """A request field of the wrong type (a dict for ``SamplingParams``, a float token id)."""


def _where(index: int | None) -> str:
    return f"prompt {index}: " if index is not None else ""


def check_params(params: object, index: int | None = None) -> SamplingParams:
    """``params`` itself, or a clear error when it is not a ``SamplingParams``."""
    if not isinstance(params, SamplingParams):
        kind = type(params).__name__
        hint = " (build one: SamplingParams(**that_dict))" if isinstance(params, dict) else ""
        raise RequestTypeError(f"{_where(index)}sampling_params must be a SamplingParams; "
                           f"got {kind}{hint}")
    return params


def check_token_ids(ids: object, vocab_size: int | None, index: int | None = None,
                    field_name: str = "prompt_token_ids") -> list[int]:
    """``ids`` as a list of ints within ``[0, vocab_size)``; floats and bools are refused."""
    where = _where(index)
    if ids is None or isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Sequence):
        raise RequestTypeError(f"{where}{field_name} must be a list of integers; "
                           f"got {type(ids).__name__}")
    out: list[int] = []
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise RequestTypeError(f"{where}{field_name}[{position}] must be an integer; "
                               f"got {token!r}")
        value = int(token)
        if value < 0 or (vocab_size is not None and value >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise RequestError(f"{where}{field_name}[{position}] = {value} is outside the "
                               f"vocabulary {bound}")
        out.append(value)
    return out


def prepare_prompt(prompt: object, encode: Callable[[str], list[int]],
                   vocab_size: int | None, max_model_len: int | None,
                   index: int | None = None) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt, checked.

    A prompt is text (``str``, or UTF-8 ``bytes``), ``{"prompt_token_ids": [...]}``
    (optionally with ``"prompt"``: its text, for the output), or ``{"prompt": text}``.
    """
    where = _where(index)
    text: str | None
    if isinstance(prompt, (bytes, bytearray)):
        raw = bytes(prompt)
        try:
            prompt = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{where}the prompt is not valid UTF-8 (byte {exc.start}: "
                               f"{raw[exc.start:exc.start + 1]!r})") from None
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from JSON's "\ud800"
            raise RequestError(f"{where}the prompt is not valid Unicode (character "
                               f"{exc.start}: {prompt[exc.start]!r})") from None
        text, ids = prompt, encode_within(encode, prompt, max_model_len, where)
    elif isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = check_token_ids(prompt["prompt_token_ids"], vocab_size, index)
            given = prompt.get("prompt")
            text = given if isinstance(given, str) else None
        elif isinstance(prompt.get("prompt"), (str, bytes, bytearray)):
            return prepare_prompt(prompt["prompt"], encode, vocab_size, max_model_len, index)
        else:
            raise RequestError(f"{where}a prompt dict needs 'prompt_token_ids' (a list of "
                               f"integers) or 'prompt' (text); got keys {sorted(prompt)}")
    elif prompt is None:
        raise RequestTypeError(f"{where}the prompt is None: give text or "
                           "{'prompt_token_ids': [...]}")
    else:
        raise RequestTypeError(f"{where}the prompt must be text or a dict with 'prompt_token_ids'; "
                           f"got {type(prompt).__name__}")
    if not ids:
        raise RequestError(f"{where}the prompt is empty: give at least one token")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise RequestError(
            f"{where}the prompt has {len(ids)} tokens; the context holds {max_model_len} "
            "(max_model_len), prompt and output together")
    return text, ids


# A text longer than max_model_len * PREFIX_CHARS_PER_TOKEN characters is
# measured first by that prefix; it is refused when the prefix alone holds
# PREFIX_MARGIN_TOKENS more tokens than the context (the margin covers a
# word cut in two at the prefix's end, which may tokenize longer than whole).
PREFIX_CHARS_PER_TOKEN = 16
PREFIX_MARGIN_TOKENS = 16


def encode_within(encode: Callable[[str], list[int]], text: str, max_model_len: int | None,
                  where: str = "") -> list[int]:
    """``encode(text)``; a text whose prefix alone overfills the context is refused
    without tokenizing the rest (the cost stays bounded by ``max_model_len``)."""
    if max_model_len is not None:
        cut = max_model_len * PREFIX_CHARS_PER_TOKEN
        if len(text) > cut:
            head = len(encode(text[:cut]))
            if head >= max_model_len + PREFIX_MARGIN_TOKENS:
                raise RequestError(
                    f"{where}the prompt has {len(text)} characters, and its first {cut} alone "
                    f"are {head} tokens; the context holds {max_model_len} (max_model_len), "
                    "prompt and output together")
    return encode(text)


def check_int(name: str, value: Any, minimum: int | None = None,
              optional: bool = False) -> None:
    """A constructor argument that must be an integer (``None`` allowed when optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestTypeError(f"{name} must be an integer; got {value!r}")
    if minimum is not None and value < minimum:
        raise RequestError(f"{name} must be >= {minimum}; got {value}")
