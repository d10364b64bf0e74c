"""mpexec.system.topology on faked machines: a sysfs directory written here,
or the node map itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpexec.system import topology


def fake_sysfs(root: Path, nodes: dict[str, str]) -> Path:
    for name, cpulist in nodes.items():
        (root / name).mkdir(parents=True)
        (root / name / "cpulist").write_text(cpulist + "\n")
    (root / "possible").write_text("0-1\n")  # not a node directory: ignored
    return root


def test_numa_nodes_from_a_fake_sysfs(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {"node0": "0-3,8-11", "node1": "4-7,12-15", "node2": ""})
    assert topology.numa_nodes(root) == {0: {0, 1, 2, 3, 8, 9, 10, 11},
                                         1: {4, 5, 6, 7, 12, 13, 14, 15}}


def test_no_node_directory_is_one_node_of_every_online_cpu(tmp_path: Path) -> None:
    from mpexec.system.procs import online_cpus

    assert topology.numa_nodes(tmp_path / "absent") == {0: online_cpus()}


def test_cpu_list_round_trip() -> None:
    assert topology.parse_cpu_list("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}
    assert topology.format_cpu_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"


TWO_NODES = {0: set(range(0, 8)), 1: set(range(8, 16))}


@pytest.mark.parametrize(("workers", "usable", "nodes", "expected"), [
    # one worker per node, each gets its whole node
    (2, range(16), TWO_NODES, [list(range(8)), list(range(8, 16))]),
    # four workers: two per node, contiguous halves
    (4, range(16), TWO_NODES, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]),
    # a cpuset that leaves node 1 only two CPUs: workers follow the usable CPUs
    (3, [0, 1, 2, 3, 4, 5, 8, 9], TWO_NODES, [[0, 1, 2], [3, 4, 5], [8, 9]]),
    # one node, uneven split
    (3, range(8), {0: set(range(8))}, [[0, 1], [2, 3, 4], [5, 6, 7]]),
    # more workers than CPUs: shared, one CPU each, round robin
    (5, [0, 1], {0: {0}, 1: {1}}, [[0], [1], [0], [1], [0]]),
    # fewer workers than nodes: a worker never spans two nodes
    (1, range(16), TWO_NODES, [list(range(8))]),
    # CPUs no node lists still count
    (2, [0, 1, 30, 31], {0: {0, 1}}, [[0, 1], [30, 31]]),
])
def test_partition(workers: int, usable: range | list[int], nodes: dict[int, set[int]],
                   expected: list[list[int]]) -> None:
    sets = topology.partition_cpus(workers, usable, nodes)
    assert sets == expected
    assert len(sets) == workers and all(sets)


def test_partition_from_a_fake_sysfs_keeps_each_worker_in_one_node(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {"node0": "0-5", "node1": "6-11", "node2": "12-17"})
    nodes = topology.numa_nodes(root)
    sets = topology.partition_cpus(6, range(18), nodes)
    assert sets == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17]]
    for cpus in sets:
        assert sum(1 for node_cpus in nodes.values() if set(cpus) & node_cpus) == 1
    assert topology.describe_cpus(sets[2], nodes) == "CPUs 6-8 (NUMA node 1)"
    assert topology.describe_cpus([12], nodes) == "CPU 12 (NUMA node 2)"
    assert topology.describe_cpus([5, 6], nodes) == "CPUs 5-6 (NUMA nodes 0,1)"


def test_partition_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="n_workers"):
        topology.partition_cpus(0, [0], {0: {0}})
    with pytest.raises(ValueError, match="no usable CPUs"):
        topology.partition_cpus(1, [], {0: {0}})
