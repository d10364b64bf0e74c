"""``mpexec generate``: text for each ``--prompt``, in order, on TP x PP workers.

Without ``--chat`` a prompt is tokenized as plain text, exactly as the
checkpoint's tokenizer does (BOS only if the checkpoint asks for one); with
``--chat`` it is the user turn of a conversation, through the checkpoint's
chat template.  ``--json`` prints one JSON object per prompt, one per line,
in the order given: ``text``, ``token_ids`` (generated only),
``finish_reason`` ("stop" or "length") and ``timings`` (wall-clock seconds).

Several nodes: ``--nnodes N --master-addr HOST --master-port PORT`` makes
this process the leader (node 0): it starts its share of the workers, waits
(``MPEXEC_STARTUP_TIMEOUT_SECONDS``) for ``mpexec node --node-rank R ...``
on every other node, and prints the outputs as on one node.  The cluster
secret, the same on every node, comes from ``--secret-file`` or
``MPEXEC_CLUSTER_SECRET``.  ``generate`` runs on node 0 only: with
``--node-rank R > 0`` it says which ``mpexec node`` command to run instead.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any, TextIO

from mpexec.cli import UsageError
from mpexec.cli.common import (
    Progress,
    add_engine_arguments,
    add_run_arguments,
    check_is_model,
    check_layout,
    check_model,
    follower_command,
    read_secret,
    require_torch,
    speculative_config,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mpexec.cli import _positive_int

    parser.add_argument("--model", default="default",
                        help="checkpoint directory, .gguf file, or a named model: 'default' "
                        "(SmolLM2-135M), 'gemma3-270m'")
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size (1)")
    parser.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallel size (1)")
    add_parallel_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[],
                        help="a prompt (repeatable; outputs come in the same order)")
    parser.add_argument("--prompts-file", default=None, metavar="FILE",
                        help="more prompts, one per line ('-': stdin): text, or JSON (a "
                        "string, {\"prompt\": ...}, {\"prompt_token_ids\": [...]}, or with "
                        "--chat {\"messages\": [...]})")
    parser.add_argument("--stream", action="store_true",
                        help="print each answer's tokens as they come (one prompt at a time)")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as a user message (chat template)")
    add_run_arguments(parser, max_tokens=64, temperature=1.0, unit="prompt")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_arguments(parser)


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Data and expert parallelism (``generate`` and ``bench``)."""
    from mpexec.cli import _positive_int

    parser.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                        help="engine replicas, each with its own TP x PP workers (1)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="split a mixture-of-experts model's experts across the TP ranks")
    parser.add_argument("--replica-restart", action="store_true",
                        help="rebuild a replica whose worker died; its requests finish on "
                             "the others")


def sampling_params(args: argparse.Namespace) -> Any:
    from mpexec.outputs import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, max_tokens=args.max_tokens)
    except ValueError as exc:
        raise UsageError(str(exc).replace("max_tokens", "--max-tokens")
                         .replace("temperature", "--temperature")
                         .replace("top_p", "--top-p").replace("top_k", "--top-k")) from None


def node_options(args: argparse.Namespace, tp: int, pp: int) -> dict[str, Any]:
    """The LLM's multi-node arguments from ``--nnodes`` and friends ({} on one node)."""
    nnodes = getattr(args, "nnodes", 1)
    rank = getattr(args, "node_rank", 0)
    addr = getattr(args, "master_addr", "127.0.0.1")
    port = getattr(args, "master_port", None)
    if not 0 <= rank < nnodes:
        raise UsageError(f"--node-rank {rank} must be in [0, --nnodes {nnodes})")
    dp = getattr(args, "data_parallel_size", 1)
    if rank > 0:
        raise UsageError(
            f"node {rank} is a follower; `mpexec {args.command}` runs on the leader (node 0) "
            f"only. On this node run: {follower_command(nnodes, rank, addr, port, dp)}")
    if nnodes == 1:
        return {}
    if args.backend != "mp":
        raise UsageError("--nnodes > 1 needs --backend mp")
    if port is None or not 0 < port <= 65536 - dp:
        dials = "dial" if dp == 1 else f"dial (and the {dp - 1} port(s) above it, one per " \
            "data parallel replica)"
        raise UsageError(f"--nnodes {nnodes} needs --master-port: the port on {addr} the "
                         f"followers {dials}")
    if (nnodes >= dp and nnodes % dp) or (nnodes < dp and dp % nnodes):
        raise UsageError(f"--nnodes {nnodes} and --data-parallel-size {dp}: one must be a "
                         "multiple of the other (a replica spans whole nodes, or a node runs "
                         "whole replicas)")
    per_replica = max(1, nnodes // dp)  # the nodes one replica spans
    if (tp * pp) % per_replica:
        over = f"--nnodes {nnodes}" if dp == 1 else (
            f"the {per_replica} nodes of a replica (--nnodes {nnodes} / "
            f"--data-parallel-size {dp})")
        raise UsageError(f"--tp {tp} x --pp {pp} = {tp * pp} workers do not split evenly "
                         f"over {over}")
    secret = read_secret(getattr(args, "secret_file", None))
    if not secret:
        raise UsageError("several nodes need a cluster secret, the same on every node: set "
                         "MPEXEC_CLUSTER_SECRET or give --secret-file")
    if len(secret.encode()) < 16:
        raise UsageError("the cluster secret must be at least 16 bytes")
    options = {"nnodes": nnodes, "node_rank": 0, "master_addr": addr, "master_port": port,
               "cluster_secret": secret}
    if getattr(args, "curve", None):
        options["cluster_curve"] = True
    return options


def device_options(args: argparse.Namespace) -> dict[str, Any]:
    """Executor fields from the device flags (only those given)."""
    affinity = getattr(args, "cpu_affinity", None)
    return {} if affinity is None else {"cpu_affinity": affinity}


def start_llm(args: argparse.Namespace, tp: int, pp: int) -> Any:
    """The LLM the command line describes (checked first, so mistakes fail fast)."""
    check_model(args.model)
    nodes = node_options(args, tp, pp)
    nnodes = nodes.get("nnodes", 1)
    dp = getattr(args, "data_parallel_size", 1)
    check_layout(tp, pp, nnodes, getattr(args, "device", "auto"), dp)
    check_is_model(args.model)
    require_torch(f"mpexec {args.command}")
    from mpexec.engine.llm import LLM
    from mpexec.errors import WorkerStartupError

    progress = Progress()
    where = f" here, waiting for {nnodes - 1} follower node(s)" if nnodes > 1 else ""
    progress.update(f"starting {dp * tp * pp // nnodes} worker(s){where} and loading "
                    f"{args.model} ...", force=True)
    try:
        return LLM(args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                   decode_context_parallel_size=getattr(args, "decode_context_parallel_size", 1),
                   prefill_context_parallel_size=getattr(args, "prefill_context_parallel_size", 1),
                   executor_backend=args.backend, dtype=getattr(args, "dtype", "auto"),
                   quantization=getattr(args, "quantization", "auto"),
                   seed=getattr(args, "seed", 0),
                   async_scheduling=getattr(args, "async_scheduling", False),
                   max_model_len=getattr(args, "max_model_len", None),
                   max_num_seqs=getattr(args, "max_num_seqs", 64), log_level=args.log_level,
                   enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
                   kv_transfer_config=getattr(args, "kv_transfer_config", None),
                   speculative_config=speculative_config(args),
                   device=getattr(args, "device", "auto"),
                   distributed_backend=getattr(args, "distributed_backend", "auto"),
                   data_parallel_size=dp,
                   enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
                   replica_restart=getattr(args, "replica_restart", False),
                   **device_options(args), **nodes)
    except WorkerStartupError as exc:
        if nnodes > 1 and "did not join" in str(exc):
            # The user's next step, on the one line the CLI prints.
            missing = re.findall(r"node (\d+) \(ranks", str(exc))
            rank: int | str = int(missing[0]) if len(missing) == 1 else "R"
            command = follower_command(nnodes, rank, nodes["master_addr"],
                                       nodes["master_port"], dp)
            raise WorkerStartupError(f"{str(exc).splitlines()[0]}; on each missing node "
                                     f"run: {command}") from exc
        raise
    finally:
        progress.done()


def read_prompts(args: argparse.Namespace) -> list[Any]:
    """``--prompt`` values, then the lines of ``--prompts-file``."""
    prompts: list[Any] = list(args.prompt)
    source = getattr(args, "prompts_file", None)
    if source is not None:
        import sys

        try:
            if source == "-":
                lines = sys.stdin.read().splitlines()
            else:
                with open(source, encoding="utf-8") as f:
                    lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --prompts-file {source}: {exc}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = line  # plain text
            if not isinstance(value, (str, dict)):
                value = line
            if isinstance(value, dict) and not ({"prompt", "prompt_token_ids", "messages"}
                                                & set(value)):
                raise UsageError(f"--prompts-file line {number}: a JSON object needs "
                                 "'prompt', 'prompt_token_ids' or 'messages'")
            prompts.append(value)
    if not prompts:
        raise UsageError("give at least one --prompt or a --prompts-file")
    return prompts


def _as_prompts(llm: Any, given: list[Any], chat: bool) -> list[Any]:
    if not chat:
        for item in given:
            if isinstance(item, dict) and "messages" in item:
                raise UsageError("a prompt with 'messages' needs --chat")
        return given
    prompts = []
    for item in given:
        if isinstance(item, dict) and "messages" in item:
            prompt = llm.chat_prompts(item["messages"])[0]
        elif isinstance(item, dict):
            raise UsageError("with --chat a prompt is text or {'messages': [...]}")
        else:
            prompt = llm.chat_prompts([{"role": "user", "content": item}])[0]
            prompt["prompt"] = item
        prompts.append(prompt)
    return prompts


def run(args: argparse.Namespace, out: TextIO,
        make_llm: Callable[[argparse.Namespace], Any] | None = None) -> int:
    params = sampling_params(args)
    given = read_prompts(args)
    if args.backend == "uni" and args.tp * args.pp != 1:
        raise UsageError("--backend uni runs one worker: use --tp 1 --pp 1, or --backend mp")
    if getattr(args, "stream", False) and args.json:
        raise UsageError("--stream prints text as it comes; --json prints whole answers: "
                         "choose one")
    llm = make_llm(args) if make_llm is not None else start_llm(args, args.tp, args.pp)
    progress = Progress()
    with llm:
        prompts = _as_prompts(llm, given, args.chat)
        if getattr(args, "stream", False):
            for index, prompt in enumerate(prompts):
                stream_one(llm, index, prompt, params, out)
            return 0

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


def stream_one(llm: Any, index: int | None, prompt: Any, params: Any, out: TextIO) -> Any:
    """Print one answer as its text grows; the final output."""
    if index is not None:
        shown = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        out.write(f"[{index}] {shown!r}\n")
    sent = ""
    final = None
    for partial in llm.generate_stream(prompt, params):
        out.write(partial.text[len(sent):])
        out.flush()
        sent = partial.text
        final = partial
    out.write("\n")
    if index is not None and final is not None:
        out.write(f"    ({len(final.token_ids)} tokens, {final.finish_reason})\n")
    out.flush()
    return final


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
