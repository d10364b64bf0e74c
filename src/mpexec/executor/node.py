"""Where ``mpexec node`` (``mpexec.cli.node``) finds the follower's entry point;
the follower lives in :mod:`mpexec.executor.nodes.follower`."""

from mpexec.executor.nodes.follower import run_follower

__all__ = ["run_follower"]
