"""``mpexec serve MODEL``: the OpenAI-compatible server on TP x PP workers.

The options carry vLLM's names (``--tensor-parallel-size/-tp``,
``--pipeline-parallel-size/-pp``, ``--host``, ``--port``, ``--api-key``,
``--served-model-name``, ``--max-model-len``, ``--max-num-seqs``, ``--dtype``,
``--executor-backend``) and the multi-node flags of ``generate``;
``--max-request-bytes`` bounds a request body (413 above it). The workers
start and the model loads before the socket is bound; a mistake there is one
line and exit status 2 (1 when the workers fail). Once serving: SIGTERM or
Ctrl-C stops accepting, gives in-flight requests ``--shutdown-grace`` seconds,
shuts the executor down and exits 0; an engine failure (a worker died) exits 1
after the open requests got their 500.
"""

from __future__ import annotations

import argparse
import sys

from mpexec.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mpexec.cli import _positive_int
    from mpexec.cli.common import add_engine_arguments, add_model_arguments
    from mpexec.cli.generate import add_parallel_arguments

    parser.add_argument("model", nargs="?", default="default",
                        help="checkpoint directory, .gguf file, or 'default' (SmolLM2-135M)")
    parser.add_argument("--model", dest="model_option", default=None,
                        help="the same as MODEL")
    parser.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tp", type=_positive_int,
                        default=1, help="tensor parallel size (1)")
    parser.add_argument("--pipeline-parallel-size", "-pp", "--pp", dest="pp",
                        type=_positive_int, default=1, help="pipeline parallel size (1)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (else MPEXEC_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model name(s) clients use (default: MODEL)")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=64,
                        help="requests in the running batch at most (64)")
    add_model_arguments(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--executor-backend", "--backend", dest="backend",
                        choices=("mp", "uni", "ray"), default="mp",
                        help="worker processes (mp), in this process (uni), Ray actors (ray)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule step N+1 while step N runs")
    parser.add_argument("--seed", type=int, default=0, help="the engine's sampling seed (0)")
    parser.add_argument("--max-request-bytes", type=_positive_int, default=8 * 1024 * 1024,
                        help="a request body larger than this is refused with a 413 "
                             "(8388608, 8 MiB)")
    parser.add_argument("--shutdown-grace", type=float, default=10.0,
                        help="seconds in-flight requests get after SIGTERM (10)")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(parser)


def _check_bind(host: str, port: int) -> None:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UsageError(f"--host {host}: {exc}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    from mpexec.cli.common import require_torch
    from mpexec.cli.generate import start_llm

    if args.model_option is not None:
        args.model = args.model_option
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port} must be in [0, 65535]")
    if args.shutdown_grace < 0:
        raise UsageError("--shutdown-grace must be >= 0")
    if args.backend == "uni" and args.tp * args.pp != 1:
        raise UsageError("--executor-backend uni runs one worker: use -tp 1 -pp 1")
    require_torch("mpexec serve")
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            raise UsageError("'mpexec serve' needs the serve extra: "
                             ".venv/bin/pip install -e '.[serve]'") from None
    from mpexec.envs import load_envs

    _check_bind(args.host, args.port)  # before minutes of loading, not after
    api_key = args.api_key or load_envs().api_key
    names = args.served_model_name or [args.model]
    llm = start_llm(args, args.tp, args.pp)
    from mpexec.engine.async_llm import AsyncLLM
    from mpexec.entrypoints.launch import serve

    engine = AsyncLLM(llm=llm)
    return serve(engine, host=args.host, port=args.port, model_names=names, api_key=api_key,
                 grace_s=args.shutdown_grace, log_level=args.uvicorn_log_level,
                 announce=sys.stderr, max_body_bytes=args.max_request_bytes)

