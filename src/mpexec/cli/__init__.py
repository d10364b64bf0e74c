"""The ``mpexec`` command: ``demo``, ``generate``, ``chat``, ``serve``, ``bench``, ``doctor``,
``node``.

Subcommands import what they need when they run, so ``mpexec --help`` stays
instant and never imports torch or starts a process.

A user's mistake (a bad flag, no such model, a layout the machine cannot
run, a prompt longer than the context, a bad sampling value) is one line on
stderr and exit status 2; a failure while running (a worker died or raised)
is one line and exit status 1.  ``-v`` shows the tracebacks behind them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

# by the number of -v flags; workers log at the same level as the driver
_LOG_LEVELS = ("WARNING", "INFO", "DEBUG")

EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake on the command line: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: the user asked for help or not.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from mpexec.version import __version__

    parser = _Parser(
        prog="mpexec",
        description="Run a model on N worker processes driven through shared memory.",
    )
    parser.add_argument("--version", action="version", version=f"mpexec {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v INFO, -vv DEBUG)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="chat with the default model on 2 CPU workers (tensor parallel)",
        description="Fetch the default model on first use, start it tensor-parallel on the "
        "CPU, answer a few chat prompts and report tokens/s, time to first token and the "
        "executor's share of a step. --executor runs the executor tour instead (no torch).",
        epilog="MPEXEC_* variables apply, e.g. MPEXEC_WORKER_MULTIPROC_METHOD=spawn mpexec demo",
    )
    demo.add_argument("--model", default="default", help="checkpoint dir, .gguf or 'default'")
    demo.add_argument("--tp", type=_positive_int, default=2, help="tensor parallel size (2)")
    demo.add_argument("--max-tokens", type=_positive_int, default=48,
                      help="tokens per answer (48)")
    demo.add_argument("--backend", choices=("mp", "uni"), default="mp", help="executor (mp)")
    demo.add_argument("--executor", action="store_true",
                      help="the executor tour: ranks, broadcast, latency, an error, stats")
    demo.add_argument("--workers", type=_positive_int, default=2,
                      help="--executor: worker processes (2)")
    demo.add_argument("--calls", type=_positive_int, default=1000,
                      help="--executor: no-op calls timed (1000)")
    demo.add_argument("--payload-mib", type=_positive_int, default=4,
                      help="--executor: size of the broadcast payload (4)")
    demo.set_defaults(handler=_run_demo)

    from mpexec.cli.generate import add_arguments as add_generate_arguments

    generate = commands.add_parser(
        "generate",
        help="generate text for prompts on N workers",
        description="Generate for each --prompt (in order) with the model on TP x PP workers.",
    )
    add_generate_arguments(generate)
    generate.set_defaults(handler=_run_generate)

    from mpexec.cli.chat import add_arguments as add_chat_arguments

    chat = commands.add_parser(
        "chat",
        help="talk with the model: each line a user turn, the reply streamed",
        description="An interactive conversation through the checkpoint's chat template; "
        "/reset starts over, /exit or Ctrl-D ends.",
    )
    add_chat_arguments(chat)
    chat.set_defaults(handler=_run_chat)

    from mpexec.cli.serve import add_arguments as add_serve_arguments

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server for the model",
        description="Serve the model over HTTP with the OpenAI API: /v1/completions, "
        "/v1/chat/completions (stream: true as server-sent events), /v1/models, /health, "
        "/metrics, /tokenize, /detokenize. SIGTERM or Ctrl-C stops it cleanly.",
    )
    add_serve_arguments(serve)
    serve.set_defaults(handler=_run_serve)

    bench = commands.add_parser(
        "bench",
        help="run the benchmark scripts and print (or plot) their tables",
        description="Run benchmarks/bench_<suite>.py from the source tree and print their "
        "tables; --plot draws them with matplotlib. Arguments after '--' go to the scripts.",
    )
    bench.add_argument("--suite", action="append", metavar="SUITE",
                       help="suite to run: benchmarks/bench_SUITE.py (repeatable; default: "
                            "mq, executor, collectives, model, engine; others include "
                            "parallel, context, kv, serve)")
    bench.add_argument("--plot", metavar="FILE.png", help="draw the tables into this image")
    bench.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=None,
                       help="replicas for the parallel suite (bench_parallel.py)")
    bench.add_argument("--decode-context-parallel-size", "-dcp", type=_positive_int,
                       default=None, help="the DCP size the context suite compares with 1")
    bench.add_argument("--prefill-context-parallel-size", "-pcp", type=_positive_int,
                       default=None, help="the PCP size the context suite compares with 1")
    bench.add_argument("script_args", nargs=argparse.REMAINDER,
                       help="'--' then arguments for the scripts")
    bench.set_defaults(handler=_run_bench)

    doctor = commands.add_parser(
        "doctor",
        help="check this machine for what mpexec needs",
        description="Check this machine for what mpexec needs; exit 1 if any check FAILs.",
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(handler=_run_doctor)

    from mpexec.cli.node import add_arguments as add_node_arguments

    node = commands.add_parser(
        "node",
        help="serve as a follower node of an executor led from another host",
        description="Join the leader at --master-addr:--master-port, take the executor's "
        "configuration from it, run this node's workers until the leader ends them.",
        epilog="exit status: 0 the leader ended the executor; 1 a worker failed, the leader "
        "was lost, or it refused this node's secret or mpexec version; 2 a usage mistake, "
        "found before joining (port, address, join timeout, nnodes, node rank) or named by "
        "the leader when it refuses this node's --nnodes or --node-rank",
    )
    add_node_arguments(node)
    node.set_defaults(handler=_run_node)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE
    level = _LOG_LEVELS[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    args.log_level = level
    prog = f"mpexec {args.command}"
    try:
        code: int = handler(args)
    except UsageError as exc:
        return _fail(prog, str(exc), EXIT_USAGE, args.verbose)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130, args.verbose)
    except Exception as exc:  # one line for the user; -v for the traceback
        from mpexec.cli.errors import classify

        kind, message = classify(exc)
        return _fail(prog, message, EXIT_USAGE if kind == "usage" else EXIT_FAILED, args.verbose)
    return code


def _fail(prog: str, message: str, code: int, verbose: int) -> int:
    if verbose:
        logging.getLogger("mpexec.cli").exception("%s failed", prog)
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    print(f"{prog}: error: {first}", file=sys.stderr)
    return code


def _run_doctor(args: argparse.Namespace) -> int:
    from mpexec.cli import doctor

    results = doctor.run_checks()
    doctor.print_report(results, sys.stdout, as_json=args.json)
    return doctor.exit_code(results)


def _run_demo(args: argparse.Namespace) -> int:
    if args.executor:
        from mpexec.cli import tour

        return tour.run(workers=args.workers, calls=args.calls,
                        payload_bytes=args.payload_mib << 20, out=sys.stdout,
                        log_level=args.log_level)
    from mpexec.cli import demo

    return demo.run(args, out=sys.stdout)


def _run_generate(args: argparse.Namespace) -> int:
    from mpexec.cli import generate

    return generate.run(args, out=sys.stdout)


def _run_chat(args: argparse.Namespace) -> int:
    from mpexec.cli import chat

    return chat.run(args)


def _run_serve(args: argparse.Namespace) -> int:
    from mpexec.cli import serve

    return serve.run(args)


def _run_node(args: argparse.Namespace) -> int:
    from mpexec.cli import node

    return node.run(args)


def _run_bench(args: argparse.Namespace) -> int:
    from mpexec.cli import bench

    return bench.run(args, out=sys.stdout)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
