"""The cluster secret and node settings: where they come from, what refuses them."""

from __future__ import annotations

import pickle
import time

import pytest

from mpexec.cli import main
from mpexec.config import ExecutorConfig, ParallelConfig
from mpexec.envs import load_envs
from mpexec.ipc.auth import generate_secret, secret_bytes

WORKER = "tests.executor.workers:EchoWorker"
SECRET = "a-test-cluster-secret-0123456789"


def test_secret_comes_from_the_environment_and_never_shows() -> None:
    envs = load_envs({"MPEXEC_CLUSTER_SECRET": SECRET})
    assert envs.cluster_secret == SECRET and SECRET not in repr(envs)
    config = ExecutorConfig.from_env(envs, worker_cls=WORKER)
    assert config.cluster_secret == SECRET and SECRET not in repr(config)
    assert ExecutorConfig.from_env(load_envs({}), worker_cls=WORKER).cluster_secret is None


def test_bad_secrets_and_node_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="cluster_secret"):
        ExecutorConfig(worker_cls=WORKER, cluster_secret="short")
    with pytest.raises(ValueError, match="node_timeout_s"):
        ExecutorConfig(worker_cls=WORKER, node_heartbeat_s=1.0, node_timeout_s=0.5)
    with pytest.raises(ValueError, match="node_heartbeat_s"):
        ExecutorConfig(worker_cls=WORKER, node_heartbeat_s=float("nan"))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        secret_bytes(b"tiny")
    assert len(generate_secret()) == 64 and generate_secret() != generate_secret()


def test_the_config_sent_to_a_follower_leaves_the_secret_out() -> None:
    from mpexec.executor.nodes.leader import node_assignment
    from mpexec.ipc import Handle

    config = ExecutorConfig(worker_cls=WORKER, cluster_secret=SECRET, parallel=ParallelConfig(
        tensor_parallel_size=2, nnodes=2, master_port=1234))
    handle = Handle([0], None, 2, 8, 0, 1, connect_ip="127.0.0.1",
                    remote_subscribe_addr="tcp://127.0.0.1:1", remote_token=5)
    sent = node_assignment(config, handle, "tcp://127.0.0.1:2", 1)
    assert sent.config.parallel.node_rank == 1 and sent.config.cluster_secret is None
    assert SECRET.encode() not in pickle.dumps(sent)


def test_mpexec_node_refuses_bad_usage(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("zmq")
    monkeypatch.setenv("MPEXEC_CLUSTER_SECRET", SECRET)
    args = ["node", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
            "--master-port", "1"]
    assert main(args) == 2
    assert "follower" in capsys.readouterr().err
    monkeypatch.delenv("MPEXEC_CLUSTER_SECRET")
    args[4] = "1"
    assert main(args) == 2
    assert "cluster secret" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "said"), [
    (["--master-port", "99999"], "argument --master-port: a TCP port is 1..65535, got 99999"),
    (["--master-port", "0"], "argument --master-port: a TCP port is 1..65535, got 0"),
    (["--join-timeout", "-1"], "argument --join-timeout: must be a positive number of "
     "seconds, got -1"),
    (["--join-timeout", "nan"], "argument --join-timeout: must be a positive number"),
    (["--master-addr", "no-such-host.invalid"], "the leader's address "
     "'no-such-host.invalid' does not resolve"),
    (["--nnodes", "1"], "nnodes must be at least 2 for a follower node"),
    (["--node-rank", "2"], "node_rank must be in 1..1 (nnodes=2; node 0 is the leader)"),
], ids=["port-too-high", "port-0", "negative-timeout", "nan-timeout", "unresolvable",
        "one-node", "rank-out-of-range"])
def test_mpexec_node_refuses_what_could_never_work_at_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flags: list[str], said: str) -> None:
    """One line, exit status 2, before any wait (a 300 s join timeout would
    otherwise be the first sign)."""
    pytest.importorskip("zmq")
    monkeypatch.setenv("MPEXEC_CLUSTER_SECRET", SECRET)
    args = {"--nnodes": "2", "--node-rank": "1", "--master-addr": "127.0.0.1",
            "--master-port": "29999", "--join-timeout": "300"}
    args.update(zip(flags[::2], flags[1::2], strict=True))
    started = time.monotonic()
    try:
        status = main(["node", *[x for pair in args.items() for x in pair]])
    except SystemExit as exc:  # argparse's own refusal of a flag's value
        status = exc.code
    assert status == 2
    assert time.monotonic() - started < 60  # a hang guard: no join was waited for
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
