"""The machine's CPUs and NUMA nodes, and how local workers share them.

::

    allowed_cpus()             the CPUs this process may run on (its affinity
                               mask: a cgroup cpuset or ``taskset`` shrinks it)
    numa_nodes(sysfs)          {node: CPUs} from <sysfs>/node<N>/cpulist
                               ({0: online CPUs} where the kernel shows none)
    partition_cpus(n, usable, nodes)
                               one CPU set per local worker (see below)
    describe_cpus(cpus, nodes) "CPUs 0-3 (NUMA node 0)", for the log

The partition keeps a worker inside one NUMA node (its memory stays local):
nodes get workers in proportion to their usable CPUs, and a node's CPUs are
cut into contiguous, near-equal slices, one per worker placed there.  With
more workers than usable CPUs, worker ``i`` gets the one CPU ``i mod n``
(node by node): workers share CPUs rather than being refused.  Reading the
topology is separate from the arithmetic, so tests pass a fake sysfs
directory or the node map itself.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path

from mpexec.system.procs import format_cpu_list, online_cpus, parse_cpu_list

SYSFS_NODES = "/sys/devices/system/node"


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order (``procs.usable_cpus`` counts them)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def numa_nodes(sysfs: str | os.PathLike[str] = SYSFS_NODES) -> dict[int, set[int]]:
    """Each NUMA node's CPUs, read from ``sysfs`` (``node<N>/cpulist``).

    A machine (or container) that shows no node directory is one node
    holding every online CPU; a node without CPUs (memory only) is left out.
    """
    nodes: dict[int, set[int]] = {}
    root = Path(sysfs)
    try:
        entries = list(root.iterdir())
    except OSError:
        entries = []
    for entry in entries:
        name = entry.name
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        try:
            cpus = parse_cpu_list((entry / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(name[4:])] = cpus
    if not nodes:
        nodes[0] = online_cpus()
    return nodes


def partition_cpus(n_workers: int, usable: Collection[int],
                   nodes: Mapping[int, Collection[int]]) -> list[list[int]]:
    """One CPU set per worker, each inside one NUMA node (see the module docstring)."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be at least 1; got {n_workers}")
    allowed = set(usable)
    if not allowed:
        raise ValueError("no usable CPUs to partition")
    # Usable CPUs node by node; CPUs no node lists form one more "node".
    per_node = [sorted(allowed & set(cpus)) for _, cpus in sorted(nodes.items())]
    listed = set().union(*map(set, per_node)) if per_node else set()
    per_node.append(sorted(allowed - listed))
    per_node = [cpus for cpus in per_node if cpus]
    total = sum(len(cpus) for cpus in per_node)
    if n_workers >= total:
        flat = [cpu for cpus in per_node for cpu in cpus]
        return [[flat[i % total]] for i in range(n_workers)]
    counts = _apportion(n_workers, [len(cpus) for cpus in per_node])
    sets: list[list[int]] = []
    for cpus, count in zip(per_node, counts, strict=True):
        for i in range(count):
            sets.append(cpus[i * len(cpus) // count:(i + 1) * len(cpus) // count])
    return sets


def _apportion(n: int, sizes: list[int]) -> list[int]:
    """``n`` workers over nodes of ``sizes`` CPUs, in proportion (largest remainder)."""
    total = sum(sizes)
    quotas = [n * size / total for size in sizes]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    return counts


def describe_cpus(cpus: Collection[int], nodes: Mapping[int, Collection[int]]) -> str:
    """``"CPUs 0-3 (NUMA node 0)"``: a CPU set and the nodes it lies in."""
    wanted = set(cpus)
    touched = sorted(node for node, node_cpus in nodes.items() if wanted & set(node_cpus))
    where = ""
    if touched:
        label = "node" if len(touched) == 1 else "nodes"
        where = f" (NUMA {label} {','.join(map(str, touched))})"
    noun = "CPU" if len(wanted) == 1 else "CPUs"
    return f"{noun} {format_cpu_list(wanted)}{where}"
