"""The ``mpexec`` command: ``mpexec doctor`` and ``mpexec demo``.

Subcommands import what they need when they run, so ``mpexec --help`` stays
instant and never imports torch or starts a process.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

# by the number of -v flags; workers log at the same level as the driver
_LOG_LEVELS = ("WARNING", "INFO", "DEBUG")


def build_parser() -> argparse.ArgumentParser:
    from mpexec import __version__

    parser = argparse.ArgumentParser(
        prog="mpexec",
        description="Drive N worker processes from one driver through shared memory.",
    )
    parser.add_argument("--version", action="version", version=f"mpexec {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v INFO, -vv DEBUG)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor",
        help="check this machine for what mpexec needs",
        description="Check this machine for what mpexec needs; exit 1 if any check FAILs.",
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(handler=_run_doctor)

    demo = commands.add_parser(
        "demo",
        help="start workers and show what the executor does",
        description="Start workers, broadcast calls, time them, show an error and shut down.",
        epilog="MPEXEC_* variables apply, e.g. MPEXEC_WORKER_MULTIPROC_METHOD=spawn mpexec demo",
    )
    demo.add_argument("--workers", type=_positive_int, default=2, help="worker processes (2)")
    demo.add_argument("--calls", type=_positive_int, default=1000, help="no-op calls timed (1000)")
    demo.add_argument(
        "--payload-mib", type=_positive_int, default=4, help="size of the broadcast payload (4)"
    )
    demo.set_defaults(handler=_run_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    level = _LOG_LEVELS[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    code: int = handler(args)
    return code


def _run_doctor(args: argparse.Namespace) -> int:
    from mpexec import doctor

    results = doctor.run_checks()
    doctor.print_report(results, sys.stdout, as_json=args.json)
    return doctor.exit_code(results)


def _run_demo(args: argparse.Namespace) -> int:
    from mpexec import demo

    return demo.run(
        workers=args.workers,
        calls=args.calls,
        payload_bytes=args.payload_mib << 20,
        out=sys.stdout,
        log_level=_LOG_LEVELS[min(args.verbose, 2)],
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
