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
from pathlib import Path
from typing import Any, TextIO

from mpexec.cli import UsageError
from mpexec.cli.common import (
    Progress,
    check_layout,
    check_model,
    follower_command,
    read_secret,
    require_torch,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mpexec.cli import _positive_int

    parser.add_argument("--model", default="default",
                        help="checkpoint directory, .gguf file, or 'default' (SmolLM2-135M)")
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size (1)")
    parser.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallel size (1)")
    parser.add_argument("--decode-context-parallel-size", "-dcp", type=_positive_int, default=1,
                        help="spread each request's KV cache over this many ranks of each TP "
                        "group (1); needs --tp >= it x the model's KV heads")
    parser.add_argument("--prefill-context-parallel-size", "-pcp", type=_positive_int,
                        default=1, help="split each long step's tokens over this many ranks "
                        "(1); the workers are TP x PP x PCP")
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
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="share the KV of common prompt prefixes (on)")
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help='KV connector, e.g. \'{"kv_connector": "CPUOffloadConnector", '
                        '"kv_connector_extra_config": {"disk_path": "/tmp/kv"}}\'')
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the workers run (auto: CUDA when visible, else CPU)")
    parser.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"),
                        default="auto",
                        help="torch.distributed backend (auto: nccl on CUDA, else gloo)")
    parser.add_argument("--cpu-affinity", choices=("auto",), default=None,
                        help="auto: pin each worker to its share of the usable CPUs, "
                             "inside one NUMA node (default: no pinning)")
    nodes = parser.add_argument_group(
        "several nodes", "this process leads (node 0); run `mpexec node` on every other node")
    nodes.add_argument("--nnodes", type=_positive_int, default=1,
                       help="nodes the workers span (1)")
    nodes.add_argument("--node-rank", type=int, default=0,
                       help="0, the leader (other nodes run `mpexec node`)")
    nodes.add_argument("--master-addr", default="127.0.0.1",
                       help="this leader's address, reachable from every node (127.0.0.1)")
    nodes.add_argument("--master-port", type=int, default=None,
                       help="the port the followers dial (needed with --nnodes > 1)")
    nodes.add_argument("--secret-file", type=Path, default=None,
                       help="file holding the cluster secret (else MPEXEC_CLUSTER_SECRET)")
    nodes.add_argument("--curve", action="store_true", default=None,
                       help="encrypt the traffic between nodes (ZeroMQ CURVE; else "
                       "MPEXEC_CLUSTER_CURVE); every follower needs it too")


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
    if rank > 0:
        raise UsageError(
            f"node {rank} is a follower; `mpexec generate` runs on the leader (node 0) only. "
            f"On this node run: {follower_command(nnodes, rank, addr, port or 'PORT')}")
    if nnodes == 1:
        return {}
    if args.backend != "mp":
        raise UsageError("--nnodes > 1 needs --backend mp")
    if port is None or not 0 < port < 65536:
        raise UsageError(f"--nnodes {nnodes} needs --master-port: the port (1-65535) on "
                         f"{addr} the followers dial")
    if (tp * pp) % nnodes:
        raise UsageError(f"--tp {tp} x --pp {pp} = {tp * pp} workers do not split evenly "
                         f"over --nnodes {nnodes}")
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
    check_layout(tp, pp, nnodes, getattr(args, "device", "auto"))
    require_torch(f"mpexec {args.command}")
    from mpexec.engine.llm import LLM
    from mpexec.errors import WorkerStartupError

    progress = Progress()
    where = f" here, waiting for {nnodes - 1} follower node(s)" if nnodes > 1 else ""
    progress.update(f"starting {tp * pp // nnodes} worker(s){where} and loading "
                    f"{args.model} ...", force=True)
    try:
        return LLM(args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                   decode_context_parallel_size=getattr(args, "decode_context_parallel_size", 1),
                   prefill_context_parallel_size=getattr(args, "prefill_context_parallel_size", 1),
                   executor_backend=args.backend, dtype=getattr(args, "dtype", "auto"),
                   seed=getattr(args, "seed", 0),
                   async_scheduling=getattr(args, "async_scheduling", False),
                   max_model_len=getattr(args, "max_model_len", None),
                   max_num_seqs=getattr(args, "max_num_seqs", 64), log_level=args.log_level,
                   enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
                   kv_transfer_config=getattr(args, "kv_transfer_config", None),
                   device=getattr(args, "device", "auto"),
                   distributed_backend=getattr(args, "distributed_backend", "auto"),
                   **device_options(args), **nodes)
    except WorkerStartupError as exc:
        if nnodes > 1 and "did not join" in str(exc):
            # The user's next step, on the one line the CLI prints.
            missing = re.findall(r"node (\d+) \(ranks", str(exc))
            rank = missing[0] if len(missing) == 1 else "R"
            command = follower_command(nnodes, rank, nodes["master_addr"],
                                       nodes["master_port"])
            raise WorkerStartupError(f"{str(exc).splitlines()[0]}; on each missing node "
                                     f"run: {command}") from exc
        raise
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
