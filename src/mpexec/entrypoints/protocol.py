"""The OpenAI request bodies, and how one becomes prompts and ``SamplingParams``.

Sampling fields travel by name: each field of a request that
``SamplingParams`` has is passed on as it is (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``seed``, ``stop``, ``stop_token_ids``, penalties,
``logit_bias``, ``min_tokens``, ``logprobs``, ...), and
``SamplingParams`` checks the values.  A field this build's
``SamplingParams`` lacks is refused with a 400 naming it, unless it is at
its neutral value (``presence_penalty: 0``, ``n: 1``).  ``stop`` is bounded
here (``MAX_STOP_STRINGS``, ``MAX_STOP_CHARS``): the engine searches every
stop string after every token.  ``n`` is served by
the server itself (``n`` requests, the ``i``-th with ``seed + i`` when a
seed is given).

Every refusal is an :class:`ApiError` whose ``body()`` is the OpenAI error
shape ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mpexec.engine.structured import guided_from_response_format
from mpexec.outputs import GuidedDecodingParams, SamplingParams

SAMPLING_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}

# The engine searches every stop string after every token of the request, on
# the thread that steps the whole batch: 10**5 of them cost ~0.1 s a token.
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 16384  # all stop strings of one request together

# request fields passed to SamplingParams by name, and the value that means "off"
_PASSED: dict[str, Any] = {
    "temperature": None, "top_p": None, "top_k": None, "min_p": None, "seed": None,
    "ignore_eos": False, "stop_token_ids": None, "stop": None,
    "include_stop_str_in_output": False, "min_tokens": 0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "logit_bias": None, "skip_special_tokens": True, "prompt_logprobs": None,
}


class ApiError(Exception):
    """A refusal in the OpenAI error shape; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int = 400,
                 kind: str = "BadRequestError", code: int | str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code,
                          "param": None, "object": "error"}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    # structured output: OpenAI's response_format, or vLLM's guided_* fields
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Any]


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` as ``model``; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object; got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ApiError(f"{where}: {first.get('msg', 'invalid')}") from None


def completion_prompts(request: CompletionRequest) -> list[str | dict[str, Any]]:
    """The prompts of a completion request: text, or token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError("prompt: must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template; content given as parts is joined into text."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError("messages: only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        item = message.model_dump(exclude_none=True)
        item["content"] = content if content is not None else ""
        out.append(item)
    return out


def sampling_params(request: _Request, max_tokens: int | None,
                    logprobs: int | bool | None) -> SamplingParams:
    """The request's ``SamplingParams``; a 400 naming the field for a bad value."""
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > MAX_STOP_STRINGS or sum(map(len, stops)) > MAX_STOP_CHARS:
        raise ApiError(f"stop: {len(stops)} strings of {sum(map(len, stops))} characters; "
                       f"this server takes at most {MAX_STOP_STRINGS} strings of "
                       f"{MAX_STOP_CHARS} characters in all")
    values: dict[str, Any] = {}
    for name, neutral in _PASSED.items():
        value = getattr(request, name)
        if value is None or (value == neutral and name not in SAMPLING_FIELDS):
            continue
        if name not in SAMPLING_FIELDS:
            raise ApiError(f"{name}: not supported by this server")
        values[name] = value
    if logprobs not in (None, False):
        if "logprobs" not in SAMPLING_FIELDS:
            raise ApiError("logprobs: not supported by this server")
        # a bool field takes "on"; an int field takes the number of top tokens
        values["logprobs"] = bool(logprobs) if isinstance(
            SAMPLING_FIELDS["logprobs"].default, bool) else int(logprobs)
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    try:
        guided = _guided(request)
        if guided is not None:
            values["guided_decoding"] = guided
        return SamplingParams(**values)
    except (ValueError, TypeError) as exc:
        raise ApiError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _guided(request: _Request) -> GuidedDecodingParams | None:
    """The request's output constraint: ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` (at most one), else ``response_format``."""
    given = {name: getattr(request, f"guided_{name}") for name in ("json", "regex", "choice")
             if getattr(request, f"guided_{name}") is not None}
    if given:
        return GuidedDecodingParams(**given)
    return guided_from_response_format(request.response_format)


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice ``index`` of ``n``: its own seed stream."""
    changes: dict[str, Any] = {}
    if "n" in SAMPLING_FIELDS:
        changes["n"] = 1
    if index and params.seed is not None:
        changes["seed"] = params.seed + index
    return dataclasses.replace(params, **changes) if changes else params

