"""``mpexec doctor``: check the machine before a user hits the problem.

Each check is a small function returning a :class:`Check` (OK, WARN or FAIL,
what it saw, and a one-line fix).  A check that raises is reported as FAIL
with the exception, so one broken check never hides the others.  Nothing
here leaves anything behind: descriptors are closed, the child process is
waited for with a timeout, sockets are closed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, TextIO

from mpexec.system.procs import usable_cpus

Status = Literal["OK", "WARN", "FAIL"]

GiB = 1 << 30
SHM_WARN_BYTES = 1 * GiB
MIN_OPEN_FILES = 1024
CHILD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def check_dev_shm(path: str = "/dev/shm") -> Check:
    note = "mpexec queues use memfd_create and are not limited by it"
    if not os.path.isdir(path):
        return Check(
            "/dev/shm",
            "WARN",
            f"{path} is missing ({note})",
            "mount a tmpfs at /dev/shm: torch and multiprocessing locks use it",
        )
    st = os.statvfs(path)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{_gib(size)} total, {_gib(free)} free ({note})"
    if size < SHM_WARN_BYTES or free < SHM_WARN_BYTES:
        return Check(
            "/dev/shm",
            "WARN",
            detail,
            "in Docker, pass --shm-size=8g: torch tensor sharing needs /dev/shm",
        )
    return Check("/dev/shm", "OK", detail)


def check_memfd() -> Check:
    if not hasattr(os, "memfd_create"):
        return Check(
            "memfd_create",
            "FAIL",
            f"os.memfd_create is missing on {sys.platform}",
            "run on Linux 3.17 or newer: queues live in memfd segments",
        )
    fd = os.memfd_create("mpexec-doctor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 1 << 20)
    finally:
        os.close(fd)
    return Check("memfd_create", "OK", "created and sized a 1 MiB memfd")


_CHILD_READS_PARENT_FD = (
    "import os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "try:\n"
    "    print(os.read(fd, 1).hex())\n"
    "finally:\n"
    "    os.close(fd)\n"
)


def check_proc_fd_open() -> Check:
    """A reader attaches to the writer's memfd through /proc/<writer pid>/fd/<n>."""
    name = "open /proc/<pid>/fd"
    if not hasattr(os, "memfd_create"):
        return Check(name, "FAIL", "no memfd_create to test with", "run on Linux")
    fd = os.memfd_create("mpexec-doctor", os.MFD_CLOEXEC)  # CLOEXEC: the child must not inherit it
    try:
        os.write(fd, b"\x2a")
        path = f"/proc/{os.getpid()}/fd/{fd}"
        result = subprocess.run(
            [sys.executable, "-c", _CHILD_READS_PARENT_FD, path],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    finally:
        os.close(fd)
    if result.returncode == 0 and result.stdout.strip() == "2a":
        return Check(name, "OK", "a child process opened this process's memfd and read it")
    last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    return Check(
        name,
        "FAIL",
        f"child could not read {path}: {last}",
        "run driver and workers as one user; do not mount /proc with hidepid",
    )


def check_libatomic() -> Check:
    machine = platform.machine()
    name = "libatomic"
    for candidate in ("libatomic.so.1", ctypes.util.find_library("atomic")):
        if not candidate:
            continue
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        if hasattr(lib, "atomic_thread_fence"):
            return Check(name, "OK", f"{candidate} loaded; memory fences use atomic_thread_fence")
    fix = "apt-get install libatomic1 (dnf/yum: libatomic)"
    if machine in ("x86_64", "AMD64"):
        return Check(
            name,
            "WARN",
            "libatomic.so.1 not loadable; x86-64 falls back to a "
            "lock-prefixed instruction as the fence",
            fix,
        )
    return Check(name, "FAIL", f"libatomic.so.1 not loadable; {machine} has no fallback fence", fix)


def check_futex() -> Check:
    from mpexec.ipc import sync

    machine = platform.machine()
    if sync.HAVE_FUTEX:
        return Check(
            "futex", "OK", f"futex(2) known for {machine}: idle readers sleep in the kernel"
        )
    return Check(
        "futex",
        "WARN",
        f"no futex syscall for {sys.platform}/{machine}: idle readers "
        "poll with short sleeps (more idle CPU, slower wake-up)",
        "run on Linux x86_64 or aarch64 for kernel wake-ups",
    )


def check_start_method() -> Check:
    import multiprocessing

    from mpexec.envs import load_envs

    name = "start method"
    try:
        method = load_envs().worker_multiproc_method
    except ValueError as exc:  # a malformed MPEXEC_* variable
        return Check(name, "FAIL", str(exc), "fix or unset the variable named above")
    available = multiprocessing.get_all_start_methods()
    detail = (
        f"workers start with {method!r} (MPEXEC_WORKER_MULTIPROC_METHOD); 'fork' becomes "
        "'spawn' once CUDA is initialised or threads run"
    )
    if method not in available:
        return Check(
            name,
            "FAIL",
            f"{method!r} is not available here ({', '.join(available)})",
            "set MPEXEC_WORKER_MULTIPROC_METHOD=spawn",
        )
    return Check(name, "OK", detail)


def check_memory() -> Check:
    from mpexec.ipc.shm import available_memory_bytes

    avail = available_memory_bytes()
    if avail is None:
        return Check(
            "memory",
            "WARN",
            "cannot read MemAvailable or the cgroup limit",
            "make /proc/meminfo readable; queue segments are charged to memory",
        )
    detail = f"{_gib(avail)} available for queue segments (MemAvailable or cgroup headroom)"
    if avail < SHM_WARN_BYTES:
        return Check(
            "memory",
            "WARN",
            detail,
            "free memory or lower ExecutorConfig.mq_max_chunk_bytes / mq_max_chunks",
        )
    return Check("memory", "OK", detail)


def check_cpus() -> Check:
    total = os.cpu_count() or 1
    usable = usable_cpus()
    detail = f"{usable} usable of {total} CPUs"
    if usable < 2:
        return Check(
            "CPUs",
            "WARN",
            detail + "; driver and workers share one core",
            "give this process more CPUs (taskset, container --cpus)",
        )
    return Check("CPUs", "OK", detail)


def check_open_files() -> Check:
    try:
        import resource
    except ImportError:
        return Check("open files", "OK", "no rlimit on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        return Check(
            "open files",
            "WARN",
            f"soft limit {shown} (hard {hard})",
            "raise it: ulimit -n 65536 (each worker holds pipes, memfds, sockets)",
        )
    return Check("open files", "OK", f"soft limit {shown}")


def check_torch() -> Check:
    if importlib.util.find_spec("torch") is None:
        return Check("torch", "OK", "not installed (optional: pip install 'mpexec[torch]')")
    try:
        import torch  # only imported when installed: it takes seconds
    except Exception as exc:  # mpexec itself does not need torch: a broken one is a warning
        return Check(
            "torch",
            "WARN",
            f"installed but does not import: {type(exc).__name__}: {exc}",
            "reinstall torch, or uninstall it if no worker needs it",
        )
    version = torch.__version__
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return Check("torch", "OK", f"torch {version}, {n} CUDA device(s) visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    extra = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return Check("torch", "OK", f"torch {version}, no CUDA device visible (CPU workers){extra}")


def check_torch_threads() -> Check:
    name = "torch threads"
    if importlib.util.find_spec("torch") is None:
        return Check(name, "OK", "torch not installed: nothing to tune")
    import torch

    cpus = usable_cpus()
    threads = torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS")
    detail = (f"torch uses {threads} intra-op threads on {cpus} usable CPUs "
              f"(OMP_NUM_THREADS={omp if omp is not None else 'unset'}); CPU workers get "
              "usable CPUs / workers each")
    if cpus and threads > cpus:
        return Check(name, "WARN", detail,
                     f"oversubscribed: export OMP_NUM_THREADS={cpus} (or fewer)")
    return Check(name, "OK", detail)


MODEL_CACHE_MIN_FREE = 512 << 20  # the default model is ~100 MiB; leave room for others


def model_cache_dir() -> str:
    """MPEXEC_CACHE_DIR, or ~/.cache/mpexec: where models are fetched to."""
    try:  # the model package's answer, where it is installed
        fetch = importlib.import_module("mpexec.models.fetch")
        return str(fetch.default_cache_dir())
    except (ImportError, AttributeError):
        return os.path.expanduser(os.environ.get("MPEXEC_CACHE_DIR") or "~/.cache/mpexec")


def check_model_cache(path: str | None = None) -> Check:
    name = "model cache"
    path = path or model_cache_dir()
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        return Check(name, "FAIL", f"{path}: {probe} is not writable",
                     "set MPEXEC_CACHE_DIR to a writable directory")
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize
    ggufs = [f for _, _, files in os.walk(path) for f in files if f.endswith(".gguf")]
    cached = f"{len(ggufs)} model file(s) cached" if ggufs else \
        "empty: 'mpexec demo' fetches the default model (~100 MiB) on first use"
    detail = f"{path} ({cached}); {_gib(free)} free on its disk"
    if free < MODEL_CACHE_MIN_FREE:
        return Check(name, "WARN", detail,
                     "free disk space, or set MPEXEC_CACHE_DIR to a disk with room")
    return Check(name, "OK", detail)


def check_tcp_port() -> Check:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", 0))
        except OSError as exc:
            return Check(
                "TCP port",
                "FAIL",
                f"cannot bind 127.0.0.1: {exc}",
                "bring up the loopback interface (ip link set lo up)",
            )
        port = sock.getsockname()[1]
    return Check("TCP port", "OK", f"bound a free port on 127.0.0.1 ({port})")


CHECKS: tuple[Callable[[], Check], ...] = (
    check_dev_shm,
    check_memfd,
    check_memory,
    check_proc_fd_open,
    check_libatomic,
    check_futex,
    check_start_method,
    check_cpus,
    check_open_files,
    check_torch,
    check_torch_threads,
    check_model_cache,
    check_tcp_port,
)


def run_checks(checks: tuple[Callable[[], Check], ...] = CHECKS) -> list[Check]:
    results = []
    for check in checks:
        try:
            results.append(check())
        except Exception as exc:  # a crashing check is a finding, not a crash of the doctor
            name = check.__name__.removeprefix("check_").replace("_", " ")
            results.append(
                Check(
                    name,
                    "FAIL",
                    f"check raised {type(exc).__name__}: {exc}",
                    "report this with the output of 'mpexec doctor'",
                )
            )
    return results


def print_report(results: list[Check], out: TextIO, *, as_json: bool = False) -> None:
    if as_json:
        json.dump([asdict(r) for r in results], out, indent=2)
        out.write("\n")
        return
    from mpexec.version import __version__

    out.write(
        f"mpexec {__version__} doctor: {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}\n\n"
    )
    width = max(len(r.name) for r in results)
    out.write(f"{'CHECK':<{width}}  STATUS  DETAIL\n")
    for r in results:
        out.write(f"{r.name:<{width}}  {r.status:<6}  {r.detail}\n")
        if r.status != "OK" and r.fix:
            out.write(f"{'':<{width}}  {'':<6}  fix: {r.fix}\n")
    counts = {s: sum(r.status == s for r in results) for s in ("OK", "WARN", "FAIL")}
    out.write(f"\n{counts['OK']} OK, {counts['WARN']} WARN, {counts['FAIL']} FAIL\n")


def exit_code(results: list[Check]) -> int:
    return 1 if any(r.status == "FAIL" for r in results) else 0


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"
