"""``mpexec node``: serve as a follower node of an executor led from another host.

Everything about the executor (worker class and arguments, parallel layout,
settings) comes from the leader over the authenticated node channel; the
flags say only how to reach it: with data parallel replicas, each
replica's nodes dial ``master_port + its data parallel rank``.  The cluster secret comes from
``--secret-file`` or ``MPEXEC_CLUSTER_SECRET`` (never a flag: command lines
are visible to every user of the machine).

Exit status: 0 when the leader ended the executor; 1 when a worker failed,
the leader was lost, or the leader refused this node's secret or mpexec
version; 2 for a usage mistake, found before joining (a port outside
1..65535, a leader address that does not resolve, a join timeout that is
not a positive number, a node rank outside 1..nnodes-1, no secret) or
named by the leader when it refuses this node's ``--nnodes`` or
``--node-rank`` (another nnodes, a node rank out of range or already
joined).  Each is one line on stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, required=True,
                        help="nodes in the executor (the leader's nnodes, at least 2)")
    parser.add_argument("--node-rank", type=int, required=True,
                        help="this node's rank (1 .. nnodes-1; node 0 is the leader)")
    parser.add_argument("--master-addr", required=True, help="the leader's address")
    parser.add_argument("--master-port", type=_port, required=True,
                        help="the leader's node channel port: its parallel.master_port, "
                        "plus this node's data parallel rank when the leader runs "
                        "--data-parallel-size > 1 (a node running several replicas runs "
                        "one `mpexec node` per replica)")
    parser.add_argument("--bind-addr", default=None,
                        help="where this node's reply queues listen (default: the leader's "
                        "node_bind_addr, loopback unless configured)")
    parser.add_argument("--secret-file", type=Path, default=None,
                        help="file holding the cluster secret (else MPEXEC_CLUSTER_SECRET)")
    parser.add_argument("--curve", action="store_true", default=None,
                        help="encrypt the traffic between nodes (ZeroMQ CURVE; else "
                        "MPEXEC_CLUSTER_CURVE); must match the leader")
    parser.add_argument("--join-timeout", type=_seconds, default=300.0,
                        help="seconds to wait for the leader (300)")


def run(args: argparse.Namespace) -> int:
    from mpexec.cli import UsageError
    from mpexec.cli.common import read_secret
    from mpexec.executor.node import run_follower

    secret = read_secret(args.secret_file)
    if not secret:
        raise UsageError("a follower node needs the leader's cluster secret: set "
                         "MPEXEC_CLUSTER_SECRET or give --secret-file")
    try:
        return run_follower(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                            secret=secret, bind_addr=args.bind_addr,
                            join_timeout_s=args.join_timeout, curve=args.curve)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
