"""Memory limits: a ring or payload that cannot fit fails at once, with the
documented OSError, never through the OOM killer.

Every test that asks for an absurd size sets the limit itself, in a child
process (RLIMIT_FSIZE, RLIMIT_AS), so nothing here really allocates it.
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from mpexec.ipc import limits
from tests.python_child import run_python

pytestmark = pytest.mark.usefixtures("leak_check")

CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from mpexec.ipc import MessageQueue
    which, limit_mib = sys.argv[1], int(sys.argv[2])
    out = {}
    rlimit = {"fsize": resource.RLIMIT_FSIZE, "as": resource.RLIMIT_AS}[which]
    def vm_size():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    base = vm_size() if which == "as" else 0
    resource.setrlimit(rlimit, (base + (limit_mib << 20), resource.RLIM_INFINITY))
    try:
        MessageQueue(1, 1, max_chunk_bytes=2**40, max_chunks=2, name="huge")
        out["ring"] = "constructed"
    except OSError as err:
        out["ring"] = str(err)
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, name="small")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    if which == "fsize":  # under RLIMIT_AS the array itself could not be made
        try:
            # np.zeros is lazily zero: its pages are never touched here
            writer.enqueue(np.zeros((2 * limit_mib) << 20, dtype=np.uint8))
            out["payload"] = "sent"
        except OSError as err:
            out["payload"] = str(err)
    writer.enqueue(np.arange(10_000))   # the queue stays usable
    out["after"] = int(reader.dequeue(timeout=5)[-1])
    reader.shutdown(); writer.shutdown()
    print(json.dumps(out))
""")


@pytest.mark.parametrize(("which", "name"), [("fsize", "RLIMIT_FSIZE"), ("as", "RLIMIT_AS")])
def test_a_ring_or_payload_over_the_limit_fails_fast_and_names_it(which: str, name: str) -> None:
    done = run_python("-c", CHILD, which, "64", timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert re.search(r"cannot reserve 2097152\.\d MiB of shared memory for queue 'huge'",
                     out["ring"])
    assert f"the limit that applies: {name}" in out["ring"]
    if which == "fsize":   # the writer never maps bulk segments: RLIMIT_AS does not apply
        assert "cannot reserve 128.0 MiB of shared memory for a 128.0 MiB message on queue "\
               "'small'" in out["payload"]
        assert name in out["payload"]
    assert out["after"] == 9_999


def test_limits_name_their_source() -> None:
    found = limits.memory_limits()
    assert any(limit.source.startswith("MemAvailable") for limit in found)
    assert all(limit.headroom >= 0 for limit in found)
    error = limits.no_memory_error(3 << 20, "queue 'q'", limits.Limit(1 << 20, "RLIMIT_AS"))
    assert str(error).startswith("[Errno 12] cannot reserve 3.0 MiB of shared memory for "
                                 "queue 'q': the limit that applies: RLIMIT_AS leaves 1.0 MiB")


def test_cgroup_limits_are_read_from_the_process_cgroup(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake v2 hierarchy and a fake v1 one: the tightest ancestor counts."""
    root = tmp_path  # type: ignore[assignment]
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "memory.max").write_text(str(100 << 20))
    (root / "a" / "memory.current").write_text(str(60 << 20))
    (root / "a" / "b" / "memory.max").write_text("max")
    (root / "a" / "b" / "memory.current").write_text(str(10 << 20))
    (root / "memory.max").write_text("max")
    v1 = root / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(50 << 20))
    (v1 / "memory.usage_in_bytes").write_text(str(20 << 20))
    cgroup_file = root / "cgroup"
    cgroup_file.write_text("0::/a/b\n4:memory:/job\n")
    monkeypatch.setattr(limits, "_CGROUP_ROOT", root)
    real_path = limits.Path

    def fake_path(path: str) -> object:
        return cgroup_file if path == "/proc/self/cgroup" else real_path(path)

    monkeypatch.setattr(limits, "Path", fake_path)
    found = {limit.source.split(" (")[0]: limit.headroom for limit in limits._cgroup_limits()}
    assert found == {f"cgroup v2 {root / 'a' / 'memory.max'}": 40 << 20,
                     f"cgroup v1 {v1 / 'memory.limit_in_bytes'}": 30 << 20}


READER_CHILD = textwrap.dedent("""
    import json, resource
    import numpy as np
    from mpexec.ipc import MessageQueue
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, name="mapped")
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.enqueue(np.ones(40 << 20, dtype=np.uint8))     # written before the limit is set
    vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:")]
    resource.setrlimit(resource.RLIMIT_AS, (vm[0] + (16 << 20), resource.RLIM_INFINITY))
    out = {}
    try:
        reader.dequeue(timeout=5)
        out["big"] = "mapped"
    except OSError as err:
        out["big"] = str(err)
    writer.enqueue(np.arange(10_000))
    out["after"] = int(reader.dequeue(timeout=5)[-1])
    reader.shutdown(); writer.shutdown()
    print(json.dumps(out))
""")


def test_a_reader_that_cannot_map_a_payload_loses_only_that_message() -> None:
    done = run_python("-c", READER_CHILD, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "mapping a 40.0 MiB message from queue 'mapped'" in out["big"]
    assert "RLIMIT_AS" in out["big"] and out["after"] == 9_999
