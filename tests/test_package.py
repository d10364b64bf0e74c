"""The package as users meet it: cheap import, lazy public names, README and CI in step."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import mpexec
from tests.python_child import run_python

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("leak_check")


def test_import_is_cheap_and_torch_free() -> None:
    code = (
        "import sys, mpexec\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('mpexec.'))\n"
        "print(loaded)\n"
    )
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['mpexec.version']"  # one constant, nothing else


@pytest.mark.parametrize("name", [n for n in mpexec.__all__ if n != "__version__"])
def test_public_names_resolve(name: str) -> None:
    value = getattr(mpexec, name)
    assert value.__name__ == name


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        _ = mpexec.NoSuchThing


def test_dir_lists_the_public_api() -> None:
    assert set(mpexec.__all__) <= set(dir(mpexec))


def test_errors_are_reexported_unchanged() -> None:
    from mpexec import errors

    assert mpexec.WorkerError is errors.WorkerError
    assert issubclass(mpexec.WorkerDiedError, mpexec.MpexecError)


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if "-m pytest" in line]
    assert commands, "README.md gives no pytest command"
    return commands[0]


def test_ci_runs_the_readme_test_command() -> None:
    command = _readme_test_command()
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r'^TEST_CMD="(.*)"$', ci, re.MULTILINE)
    assert match, ".ci/run has no TEST_CMD line"
    assert match.group(1) == command


def test_version_matches_pyproject() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{mpexec.__version__}"' in pyproject


def test_readme_quick_start_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    # the executor example (the LLM example needs torch and the model)
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
              if "WorkerBase" in b]
    assert blocks, "README.md has no executor example"
    script = tmp_path / "quick_start.py"
    script.write_text(blocks[0])
    result = run_python(str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "[49, 49]"
    assert lines[2] == "9"
    assert lines[3].startswith("MethodStats(calls=2")


def test_setproctitle_is_a_core_dependency() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("setproctitle") for dep in project["dependencies"])


def test_executor_imports_without_torch() -> None:
    result = run_python("-c", textwrap.dedent("""
        import sys
        import mpexec.executor, mpexec.executor.multiproc, mpexec.executor.worker_proc
        import mpexec.system
        assert "torch" not in sys.modules, "executor imported torch"
    """))
    assert result.returncode == 0, result.stderr
