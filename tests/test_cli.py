"""Tests of the ``mpexec`` command: help, version, doctor, the executor tour, user errors."""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

import mpexec
from mpexec import cli
from mpexec.cli import doctor
from tests.python_child import run_python

# Several tests start processes: each must leave none behind (see conftest).
pytestmark = pytest.mark.usefixtures("leak_check")


def run_mpexec(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return run_python("-m", "mpexec", *args, timeout=timeout)


def test_help_lists_subcommands() -> None:
    result = run_mpexec("--help")
    assert result.returncode == 0, result.stderr
    assert "doctor" in result.stdout
    assert "demo" in result.stdout
    assert "generate" in result.stdout and "bench" in result.stdout


def test_version() -> None:
    result = run_mpexec("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"mpexec {mpexec.__version__}"


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: mpexec" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["demo", "--workers", "0"], ["demo", "--calls", "x"]])
def test_demo_rejects_bad_numbers(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "demo" in capsys.readouterr().err


def test_help_does_not_import_heavy_modules() -> None:
    code = (
        "import sys\n"
        "from mpexec.cli import build_parser\n"
        "build_parser().format_help()\n"
        "heavy = [m for m in ('torch', 'numpy', 'mpexec.executor', 'mpexec.engine',\n"
        "                     'mpexec.cli.doctor') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_doctor_passes_here() -> None:
    result = run_mpexec("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 FAIL" in result.stdout
    for name in ("/dev/shm", "memfd_create", "open /proc/<pid>/fd", "libatomic", "TCP port"):
        assert name in result.stdout


def test_doctor_json() -> None:
    result = run_mpexec("doctor", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {row["status"] for row in rows} <= {"OK", "WARN", "FAIL"}
    assert {"name", "status", "detail", "fix"} <= set(rows[0])


def test_doctor_reports_a_crashing_check_as_fail() -> None:
    def check_exploding() -> doctor.Check:
        raise RuntimeError("boom")

    def check_fine() -> doctor.Check:
        return doctor.Check("fine", "OK", "all good")

    results = doctor.run_checks((check_exploding, check_fine))
    assert [r.status for r in results] == ["FAIL", "OK"]
    assert results[0].name == "exploding"
    assert "RuntimeError: boom" in results[0].detail
    assert doctor.exit_code(results) == 1
    assert doctor.exit_code(results[1:]) == 0


def test_doctor_report_shows_fix_only_when_not_ok() -> None:
    results = [
        doctor.Check("a", "OK", "fine", "never shown"),
        doctor.Check("b", "WARN", "meh", "do this"),
    ]
    out = io.StringIO()
    doctor.print_report(results, out)
    text = out.getvalue()
    assert "never shown" not in text
    assert "fix: do this" in text
    assert "1 OK, 1 WARN, 0 FAIL" in text


def test_doctor_missing_dev_shm_is_only_a_warning(tmp_path: Path) -> None:
    check = doctor.check_dev_shm(str(tmp_path / "missing"))
    assert check.status == "WARN"
    assert "memfd" in check.detail


def test_executor_tour_runs_end_to_end() -> None:
    result = run_mpexec("demo", "--executor", "--workers", "2", "--calls", "50",
                        "--payload-mib", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "FAILED" not in out
    assert "rank 0 pid" in out and "rank 1 pid" in out
    assert "WorkerError from rank 1 (ValueError)" in out
    assert "worker processes left: none" in out
    # the failing worker's own log line carries its prefix
    assert "(Worker_TP1 pid=" in result.stderr
    # the workers were grandchildren, out of leak_check's sight: check them by pid
    pids = [int(p) for p in re.findall(r"rank \d+ pid (\d+)", out)]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def _one_line_error(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(("args", "needles"), [
    (["generate", "--model", "/no/such/model", "--prompt", "hi"], ["no such model"]),
    (["generate", "--prompt", "hi", "--distributed-backend", "mpi"], ["invalid choice"]),
    (["generate", "--prompt", "hi", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["generate"], ["--prompt"]),
    (["generate", "--prompt", "hi", "--temperature", "-1"], ["--temperature must be >= 0"]),
    (["generate", "--prompt", "hi", "--top-p", "2"], ["--top-p must be in (0, 1]"]),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], ["--max-tokens must be"]),
    (["generate", "--prompt", "hi", "--tp", "2", "--backend", "uni"], ["--backend uni"]),
    (["demo", "--tp", "x"], ["expected an integer"]),
    (["bench", "--suite", "nope"], ["no benchmark script for suite 'nope'"]),
])
def test_user_mistakes_are_one_line_and_exit_2(args: list[str], needles: list[str]) -> None:
    _one_line_error(run_mpexec(*args), 2, *needles)


def test_bench_collects_the_harness_tables_as_json_and_plots(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec.cli import bench

    tables_file = tmp_path / "tables.jsonl"
    script = ("import sys\n"
              f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'benchmarks')!r})\n"
              "from harness import render\n"
              "print(render('calls against workers', ['workers', 'median', 'p99'],\n"
              "             [['1', '12.5 us', '30 us'], ['2 (pinned)', '20.0 us', '41 us']]))\n"
              "print(render('second', ['mode', 'tok/s'], [['sync', 100], ['async', 130]]))\n")
    # the harness reads MPEXEC_BENCH_TABLES once, at import: a child of its own
    monkeypatch.setenv("MPEXEC_BENCH_TABLES", str(tables_file))
    result = run_python("-c", script, timeout=60)
    monkeypatch.delenv("MPEXEC_BENCH_TABLES")
    assert result.returncode == 0, result.stderr
    assert "calls against workers" in result.stdout
    tables = bench.read_tables(tables_file)
    assert [t.title for t in tables] == ["calls against workers", "second"]
    assert tables[0].headers == ["workers", "median", "p99"]
    assert tables[0].rows[1] == ["2 (pinned)", "20.0 us", "41 us"]
    assert tables[1].rows == [["sync", "100"], ["async", "130"]]
    assert bench.read_tables(tmp_path / "none.jsonl") == []
    pytest.importorskip("matplotlib")
    image = tmp_path / "bench.png"
    # in a child: matplotlib keeps its font files open for the life of the process
    code = ("import sys\nfrom pathlib import Path\nfrom mpexec.cli import bench\n"
            "print(bench.plot(bench.read_tables(Path(sys.argv[1])), sys.argv[2]))\n")
    result = run_python("-c", code, str(tables_file), str(image), timeout=90)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2"
    assert image.read_bytes()[:4] == b"\x89PNG"


def test_bench_without_scripts_says_so(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from mpexec.cli import bench

    monkeypatch.setattr(bench, "benchmarks_dir", lambda: None)
    assert cli.main(["bench", "--suite", "mq"]) == 2
    assert "not here: they live in the source tree" in capsys.readouterr().err


def test_doctor_checks_torch_threads_and_model_cache(tmp_path: Path) -> None:
    check = doctor.check_model_cache(str(tmp_path / "cache"))
    assert check.status == "OK" and "free on its disk" in check.detail
    assert doctor.check_torch_threads().status in ("OK", "WARN")


def test_bench_passes_layout_options_to_the_suite_that_takes_them() -> None:
    from mpexec.cli import bench, build_parser

    args = build_parser().parse_args(["bench", "--suite", "context", "-dcp", "4", "-pcp", "2",
                                      "-dp", "3"])
    assert bench.suite_options("context", args) == ["--dcp", "4", "--pcp", "2"]
    assert bench.suite_options("parallel", args) == ["--data-parallel-size", "3"]
    assert bench.suite_options("mq", args) == []
