"""``mpexec generate --stream`` / ``--prompts-file`` and ``mpexec chat`` on the fake model."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from mpexec import cli
from mpexec.outputs import SamplingParams
from tests.engine.fake_tokenizer import FakeTokenizer
from tests.engine.fake_worker import reference_tokens
from tests.engine.test_cli_generate import use_fake_model

pytestmark = pytest.mark.usefixtures("leak_check")

TOK = FakeTokenizer()


def expected(ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    want, reason = reference_tokens(ids, SamplingParams(temperature=0, max_tokens=max_tokens),
                                    eos_token_ids=(3,), max_model_len=64)
    return TOK.decode(want), len(want), reason


def test_stream_prints_each_answer_as_it_grows(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_model(monkeypatch)
    assert cli.main(["generate", "--backend", "uni", "--temperature", "0", "--max-tokens",
                     "6", "--stream", "--prompt", "one", "--prompt", "two"]) == 0
    out = capsys.readouterr().out
    want = ""
    for index, prompt in enumerate(["one", "two"]):
        text, count, reason = expected(TOK.encode(prompt), 6)
        want += f"[{index}] {prompt!r}\n{text}\n    ({count} tokens, {reason})\n"
    assert out == want


def test_prompts_file_lines_and_stdin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_model(monkeypatch)
    lines = ["plain text line", json.dumps("a json string"),
             json.dumps({"prompt_token_ids": [5, 6, 7]}), "", json.dumps({"prompt": "dict"})]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    base = ["generate", "--backend", "uni", "--temperature", "0", "--max-tokens", "4", "--json"]
    assert cli.main([*base, "--prompt", "first", "--prompts-file", str(path)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    prompts = [TOK.encode("first"), TOK.encode("plain text line"),
               TOK.encode("a json string"), [5, 6, 7], TOK.encode("dict")]
    assert [r["text"] for r in rows] == [expected(p, 4)[0] for p in prompts]

    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n"))
    assert cli.main([*base, "--prompts-file", "-"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["text"] == expected(TOK.encode("from stdin"), 4)[0]

    path.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    assert cli.main([*base, "--prompts-file", str(path)]) == 2
    assert "line 1: a JSON object needs 'prompt'" in capsys.readouterr().err
    assert cli.main(["generate", "--backend", "uni"]) == 2
    assert "give at least one --prompt" in capsys.readouterr().err


def test_chat_is_a_conversation(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_model(monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\n/reset\nhello\n/exit\nignored\n"))
    assert cli.main(["chat", "--backend", "uni", "--temperature", "0",
                     "--max-tokens", "5"]) == 0
    replies = capsys.readouterr().out.splitlines()
    first = expected(TOK.apply_chat_template([{"role": "user", "content": "hello"}]), 5)[0]
    assert replies == [first, first]  # /reset: the second turn starts over


@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
def test_a_path_that_is_no_model_exits_2(command: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    argv = [command, str(tmp_path)] if command == "serve" else \
        [command, "--model", str(tmp_path)]
    if command == "generate":
        argv += ["--prompt", "x"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "directory without config.json" in err[0]
