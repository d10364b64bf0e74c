"""``mpexec generate`` on the fake model: JSON lines, prompt errors, a dying worker."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from mpexec import cli
from mpexec.cli import generate
from mpexec.engine.llm import LLM
from mpexec.outputs import SamplingParams
from tests.engine.conftest import FAKE_WORKER
from tests.engine.fake_tokenizer import FakeTokenizer
from tests.engine.fake_worker import reference_tokens

pytestmark = pytest.mark.usefixtures("leak_check")


def use_fake_model(monkeypatch: pytest.MonkeyPatch, **worker_kwargs: Any) -> None:
    def start(args: argparse.Namespace, tp: int, pp: int) -> LLM:
        return LLM("fake", worker_cls=FAKE_WORKER, tokenizer=FakeTokenizer(),
                   worker_kwargs={"block_size": 4, "seed": args.seed, **worker_kwargs},
                   max_model_len=64, block_size=4, tensor_parallel_size=tp,
                   pipeline_parallel_size=pp, executor_backend=args.backend,
                   async_scheduling=args.async_scheduling, shutdown_grace_s=2.0,
                   data_parallel_size=getattr(args, "data_parallel_size", 1))

    monkeypatch.setattr(generate, "start_llm", start)


def test_json_lines_in_prompt_order(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_model(monkeypatch)
    prompts = ["first prompt", "b", "the third one"]
    argv = ["generate", "--json", "--temperature", "0", "--max-tokens", "7", "--backend", "mp",
            "--tp", "2", "--async-scheduling"]
    for p in prompts:
        argv += ["--prompt", p]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    tok = FakeTokenizer()
    for index, (prompt, line) in enumerate(zip(prompts, lines, strict=True)):
        row = json.loads(line)
        want, reason = reference_tokens(tok.encode(prompt), SamplingParams(temperature=0,
                                        max_tokens=7), eos_token_ids=(3,), max_model_len=64)
        assert row["index"] == index and row["prompt"] == prompt
        assert row["token_ids"] == want and row["finish_reason"] == reason
        assert row["text"] == tok.decode(want)
        t = row["timings"]
        assert t["arrival"] <= t["first_token"] <= t["finish"]


def test_two_data_parallel_replicas_keep_the_prompt_order(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_model(monkeypatch)
    prompts = ["one", "second prompt", "3", "four four"]
    argv = ["generate", "--json", "--temperature", "0", "--max-tokens", "5", "-dp", "2"]
    for p in prompts:
        argv += ["--prompt", p]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    tok = FakeTokenizer()
    for prompt, row in zip(prompts, rows, strict=True):
        want, _ = reference_tokens(tok.encode(prompt), SamplingParams(temperature=0,
                                   max_tokens=5), eos_token_ids=(3,), max_model_len=64)
        assert row["prompt"] == prompt and row["token_ids"] == want


def test_chat_and_plain_text_output(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_model(monkeypatch)
    assert cli.main(["generate", "--backend", "uni", "--chat", "--prompt", "hi",
                     "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[0] 'hi'\n") and "(3 tokens, length)" in out


def test_prompt_longer_than_the_context_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_model(monkeypatch)
    code = cli.main(["generate", "--backend", "uni", "--prompt", "x" * 80])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "the prompt has 80 tokens" in err and "max_model_len" in err


def test_a_worker_dying_during_generate_exits_1(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_model(monkeypatch, die_at_step=2, fault_rank=1)
    code = cli.main(["generate", "--backend", "mp", "--tp", "2", "--prompt", "hello",
                     "--max-tokens", "20", "--temperature", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert "mpexec generate: error: a worker died" in err and "SIGKILL" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("flags", "secret", "message"), [
    (["--nnodes", "2", "--master-port", "29500"], None,
     "several nodes need a cluster secret, the same on every node: set MPEXEC_CLUSTER_SECRET"),
    (["--nnodes", "2", "--master-port", "29500"], "short",
     "the cluster secret must be at least 16 bytes"),
    (["--nnodes", "2"], "a-test-cluster-secret-0123456789", "--nnodes 2 needs --master-port"),
    (["--nnodes", "2", "--master-port", "29500", "--tp", "3"],
     "a-test-cluster-secret-0123456789", "do not split evenly over --nnodes 2"),
    (["--nnodes", "4", "--master-port", "29500", "-dp", "2", "--tp", "3"],
     "a-test-cluster-secret-0123456789",
     "do not split evenly over the 2 nodes of a replica (--nnodes 4 / --data-parallel-size 2)"),
    (["--nnodes", "3", "--master-port", "29500", "-dp", "2", "--tp", "1"],
     "a-test-cluster-secret-0123456789", "--nnodes 3 and --data-parallel-size 2: one must be"),
    (["--nnodes", "2", "--master-port", "29500", "--backend", "uni", "--tp", "1"],
     "a-test-cluster-secret-0123456789", "--nnodes > 1 needs --backend mp"),
    (["--nnodes", "2", "--node-rank", "2"], None, "--node-rank 2 must be in [0, --nnodes 2)"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port",
      "29500"], None,
     "On this node run: MPEXEC_CLUSTER_SECRET=... mpexec node --nnodes 2 --node-rank 1 "
     "--master-addr 10.0.0.1 --master-port 29500"),
])
def test_several_nodes_mistakes_are_one_line_before_anything_starts(
        flags: list[str], secret: str | None, message: str, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    if secret is None:
        monkeypatch.delenv("MPEXEC_CLUSTER_SECRET", raising=False)
    else:
        monkeypatch.setenv("MPEXEC_CLUSTER_SECRET", secret)
    code = cli.main(["generate", "--model", str(tmp_path), "--tp", "2", "--prompt", "x",
                     *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and message in err


def test_the_secret_file_wins_over_the_environment(tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-the-file-0123456789\n")
    monkeypatch.setenv("MPEXEC_CLUSTER_SECRET", "from-the-environment-0123")
    args = cli.build_parser().parse_args(
        ["generate", "--prompt", "x", "--tp", "2", "--nnodes", "2", "--master-port", "29500",
         "--secret-file", str(secret_file)])
    options = generate.node_options(args, 2, 1)
    assert options == {"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1",
                       "master_port": 29500, "cluster_secret": "from-the-file-0123456789"}
    args = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    assert generate.node_options(args, 1, 1) == {}


def test_curve_reaches_the_leader_and_the_follower(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.cli import node

    monkeypatch.setenv("MPEXEC_CLUSTER_SECRET", "a-secret-of-enough-bytes")
    flags = ["generate", "--prompt", "x", "--tp", "2", "--nnodes", "2", "--master-port",
             "29500"]
    plain = generate.node_options(cli.build_parser().parse_args(flags), 2, 1)
    assert "cluster_curve" not in plain  # MPEXEC_CLUSTER_CURVE decides
    curved = generate.node_options(cli.build_parser().parse_args([*flags, "--curve"]), 2, 1)
    assert curved["cluster_curve"] is True

    seen: dict[str, object] = {}
    monkeypatch.setattr("mpexec.executor.node.run_follower",
                        lambda *a, **kw: seen.update(kw) or 0)
    follower = ["node", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                "--master-port", "29500"]
    assert node.run(cli.build_parser().parse_args([*follower, "--curve"])) == 0
    assert seen["curve"] is True
    assert node.run(cli.build_parser().parse_args(follower)) == 0
    assert seen["curve"] is None  # MPEXEC_CLUSTER_CURVE decides


def test_kv_flags_reach_the_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []

    def start(args: argparse.Namespace, tp: int, pp: int) -> LLM:
        seen.append(args)
        raise ValueError("stop here")

    monkeypatch.setattr(generate, "start_llm", start)
    config = '{"kv_connector": "CPUOffloadConnector"}'
    assert cli.main(["generate", "--prompt", "x", "--no-enable-prefix-caching",
                     "--kv-transfer-config", config]) == 2
    assert cli.main(["generate", "--prompt", "x"]) == 2
    assert seen[0].enable_prefix_caching is False and seen[0].kv_transfer_config == config
    assert seen[1].enable_prefix_caching is True and seen[1].kv_transfer_config is None


@pytest.mark.parametrize(("config", "message"), [
    ("{not json", "not valid JSON"),
    ('{"kv_connector": "Nope"}', "unknown kv_connector"),
    ('{"kv_connector": "CPUOffloadConnector", "color": 1}', "unknown keys"),
])
def test_bad_kv_transfer_config_is_refused_before_any_worker_starts(config: str,
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM("fake", worker_cls=FAKE_WORKER, tokenizer=FakeTokenizer(), max_model_len=64,
            kv_transfer_config=config)


def test_speculative_flags_reach_the_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def start(args: argparse.Namespace, tp: int, pp: int) -> LLM:
        seen.append(generate.speculative_config(args))
        raise ValueError("stop here")

    monkeypatch.setattr(generate, "start_llm", start)
    config = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    assert cli.main(["generate", "--prompt", "x", "--speculative-ngram", "4"]) == 2
    assert cli.main(["generate", "--prompt", "x", "--speculative-config", config]) == 2
    assert cli.main(["generate", "--prompt", "x"]) == 2
    assert seen == [{"method": "ngram", "num_speculative_tokens": 4}, config, None]
    with pytest.raises(SystemExit):  # one or the other
        cli.build_parser().parse_args(["generate", "--speculative-ngram", "2",
                                       "--speculative-config", config])


@pytest.mark.parametrize(("config", "message"), [
    ("{not json", "not valid JSON"),
    ('{"method": "medusa"}', "method must be one of"),
    ({"num_speculative_tokens": 4}, "needs the model worker"),
])
def test_bad_speculative_config_is_refused_before_any_worker_starts(config: Any,
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM("fake", worker_cls=FAKE_WORKER, tokenizer=FakeTokenizer(), max_model_len=64,
            speculative_config=config)
