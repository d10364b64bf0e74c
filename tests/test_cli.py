"""Tests of the ``mpexec`` command: help, version, doctor."""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

import mpexec
from mpexec import cli, doctor
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
        "heavy = [m for m in ('torch', 'numpy', 'mpexec.executor', 'mpexec.doctor') "
        "if m in sys.modules]\n"
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


def test_demo_runs_end_to_end() -> None:
    result = run_mpexec("demo", "--workers", "2", "--calls", "50", "--payload-mib", "1")
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
