"""``mpexec generate``: text for each ``--prompt``, in order, on TP x PP workers.

Without ``--chat`` a prompt is tokenized as plain text, exactly as the
checkpoint's tokenizer does (BOS only if the checkpoint asks for one); with
``--chat`` it is the user turn of a conversation, through the checkpoint's
chat template.  ``--json`` prints one JSON object per prompt, one per line,
in the order given: ``text``, ``token_ids`` (generated only),
``finish_reason`` ("stop" or "length") and ``timings`` (wall-clock seconds).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, TextIO

from mpexec.cli import UsageError
from mpexec.cli.common import Progress, check_layout, check_model, require_torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mpexec.cli import _positive_int

    parser.add_argument("--model", default="default",
                        help="checkpoint directory, .gguf file, or 'default' (SmolLM2-135M)")
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size (1)")
    parser.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallel size (1)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt (repeatable; outputs come in the same order)")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as a user message (chat template)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt (64)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    parser.add_argument("--backend", choices=("mp", "uni"), default="mp",
                        help="executor: worker processes (mp) or in this process (uni)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule step N+1 while step N runs")
    parser.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="context length (default: the checkpoint's)")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")


def sampling_params(args: argparse.Namespace) -> Any:
    from mpexec.outputs import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, max_tokens=args.max_tokens)
    except ValueError as exc:
        raise UsageError(str(exc).replace("max_tokens", "--max-tokens")
                         .replace("temperature", "--temperature")
                         .replace("top_p", "--top-p").replace("top_k", "--top-k")) from None


def start_llm(args: argparse.Namespace, tp: int, pp: int) -> Any:
    """The LLM the command line describes (checked first, so mistakes fail fast)."""
    check_model(args.model)
    check_layout(tp, pp)
    require_torch(f"mpexec {args.command}")
    from mpexec.engine.llm import LLM

    progress = Progress()
    progress.update(f"starting {tp * pp} worker(s) and loading {args.model} ...", force=True)
    try:
        return LLM(args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                   executor_backend=args.backend, dtype=getattr(args, "dtype", "auto"),
                   seed=getattr(args, "seed", 0),
                   async_scheduling=getattr(args, "async_scheduling", False),
                   max_model_len=getattr(args, "max_model_len", None),
                   max_num_seqs=getattr(args, "max_num_seqs", 64), log_level=args.log_level)
    finally:
        progress.done()


def run(args: argparse.Namespace, out: TextIO,
        make_llm: Callable[[argparse.Namespace], Any] | None = None) -> int:
    params = sampling_params(args)
    if args.backend == "uni" and args.tp * args.pp != 1:
        raise UsageError("--backend uni runs one worker: use --tp 1 --pp 1, or --backend mp")
    llm = make_llm(args) if make_llm is not None else start_llm(args, args.tp, args.pp)
    progress = Progress()
    with llm:
        if args.chat:
            prompts: list[Any] = llm.chat_prompts(
                [[{"role": "user", "content": p}] for p in args.prompt])
            for prompt, text in zip(prompts, args.prompt, strict=True):
                prompt["prompt"] = text
        else:
            prompts = list(args.prompt)

        def show(finished: int, total: int, tokens: int) -> None:
            progress.update(f"generating: {finished}/{total} prompts done, {tokens} tokens")

        try:
            outputs = llm.generate(prompts, params, progress=show)
        finally:
            progress.done()
    for index, output in enumerate(outputs):
        if args.json:
            out.write(json.dumps(as_json(index, output)) + "\n")
        else:
            out.write(f"[{index}] {output.prompt!r}\n{output.text}\n")
            out.write(f"    ({len(output.token_ids)} tokens, {output.finish_reason})\n")
    out.flush()
    return 0


def as_json(index: int, output: Any) -> dict[str, Any]:
    m = output.metrics
    return {
        "index": index,
        "prompt": output.prompt,
        "num_prompt_tokens": len(output.prompt_token_ids),
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "timings": {
            "arrival": m.arrival_time,
            "first_token": m.first_token_time,
            "finish": m.finish_time,
            "time_to_first_token_s": m.time_to_first_token_s,
            "latency_s": m.latency_s,
        },
    }
