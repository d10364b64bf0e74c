"""What a request must pass, and is given, before it is queued.

::

    (prompt ids, SamplingParams) ──► RequestBuilder.build ──► Request
        n == 1 (the caller fans out n > 1)                  ValueError / TypeError:
        logit_bias, stop_token_ids inside the vocabulary     it could never run
        stop strings: a StopStringText over the tokenizer
        guided_decoding: a Guide (compiled here, or the one given)

``Engine.add_request`` builds every request here, and so does the
data-parallel front end for a request that arrives while every replica is
being rebuilt (it waits in the front end and goes to whichever replica
comes back first, with its stop strings and its constraint).  The replicas
of one front end share one builder, so a constraint is compiled once for
all of them (``StructuredOutputs`` keeps the compiled automata).

``compile_guide`` is the costly part of building a constrained request (up
to ``structured.COMPILE_TIMEOUT_S``); ``AsyncLLM`` runs it on a thread of
its own and hands the result to ``build``, so the engine thread never
waits for a compile.  ``cancel_compiles`` ends the compiles in flight (a
shutting-down server does not wait them out).
"""

from __future__ import annotations

import threading
from typing import Any

from mpexec.engine.request import Request
from mpexec.engine.stop_strings import StopStringText
from mpexec.engine.structured import StructuredOutputs
from mpexec.outputs import GuidedDecodingParams, SamplingParams


class RequestBuilder:
    def __init__(self, tokenizer: Any, vocab_size: int | None,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._structured: StructuredOutputs | None = None
        self._lock = threading.Lock()  # the compile threads and the engine thread

    def build(self, prompt_token_ids: list[int], params: SamplingParams, req_id: str,
              arrival_time: float | None = None, grammar: Any = None) -> Request:
        """The request, checked against the model (``grammar``: the automaton
        ``compile_guide`` made for ``params.guided_decoding``, else compiled here)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams; got "
                            f"{type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"n={params.n}: add one request per completion (child_params)")
        if self.vocab_size is not None:
            for name, ids in (("logit_bias", params.logit_bias or {}),
                              ("stop_token_ids", params.stop_token_ids)):
                bad = [t for t in ids if t >= self.vocab_size]
                if bad:
                    raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                     f"[0, {self.vocab_size})")
        request = Request(req_id, list(prompt_token_ids), params)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need an engine with a tokenizer")
            request.stop_text = StopStringText(self.tokenizer, params)
        if params.guided_decoding is not None:
            request.grammar = grammar if grammar is not None \
                else self.compile_guide(params.guided_decoding)
        return request

    def compile_guide(self, guided: GuidedDecodingParams) -> Any:
        """A fresh automaton for one constrained request (ValueError: a bad
        regex or schema, or one that does not compile within the bounds).
        Safe from any thread."""
        return self.structured_outputs().guide(guided)

    def structured_outputs(self) -> StructuredOutputs:
        with self._lock:
            if self._structured is None:
                if self.tokenizer is None or self.vocab_size is None or not self.eos_token_ids:
                    raise ValueError("structured output needs an engine with a tokenizer, "
                                     "the model's vocab_size and an EOS token")
                self._structured = StructuredOutputs(self.tokenizer, self.vocab_size,
                                                     self.eos_token_ids[0])
            return self._structured

    def cancel_compiles(self) -> None:
        """End the compiles in flight: each raises ``ValueError`` at once."""
        with self._lock:
            structured = self._structured
        if structured is not None:
            structured.cancel_compiles()
