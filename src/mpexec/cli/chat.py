"""``mpexec chat``: an interactive conversation with the model, the reply streamed.

Each line read (from a terminal or a pipe) is a user turn; the reply is
printed as its tokens arrive and both join the conversation, which goes
through the checkpoint's chat template.  ``/reset`` starts over, ``/exit``
or end of input (Ctrl-D) ends; Ctrl-C during a reply stops that reply
(its request is aborted) and Ctrl-C at the prompt ends the session.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mpexec.cli import _positive_int
    from mpexec.cli.common import add_engine_arguments, add_run_arguments

    parser.add_argument("--model", default="default",
                        help="checkpoint directory, .gguf file, or 'default' (SmolLM2-135M)")
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size (1)")
    parser.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallel size (1)")
    parser.add_argument("--system", default=None, help="a system message to start with")
    add_run_arguments(parser, max_tokens=256, temperature=0.7, unit="reply")
    add_engine_arguments(parser)


def run(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None,
        make_llm: Callable[[argparse.Namespace], Any] | None = None) -> int:
    from mpexec.cli.generate import sampling_params, start_llm, stream_one

    stdin = stdin or sys.stdin
    out = out or sys.stdout
    params = sampling_params(args)
    interactive = stdin.isatty()
    llm = make_llm(args) if make_llm is not None else start_llm(args, args.tp, args.pp)
    start: list[dict[str, str]] = []
    if args.system:
        start.append({"role": "system", "content": args.system})
    conversation = list(start)
    with llm:
        if interactive:
            out.write("(/reset starts over, /exit or Ctrl-D ends)\n")
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            try:
                line = stdin.readline()
            except KeyboardInterrupt:
                out.write("\n")
                break
            if not line or line.strip() == "/exit":
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip() == "/reset":
                conversation = list(start)
                continue
            conversation.append({"role": "user", "content": text})
            prompt = llm.chat_prompts(conversation)[0]
            try:
                reply = stream_one(llm, None, prompt, params, out)
            except KeyboardInterrupt:
                out.write("\n(stopped)\n")
                conversation.pop()
                continue
            conversation.append({"role": "assistant", "content": reply.text if reply else ""})
    return 0
