"""Process plumbing shared by the driver and its workers.

Nothing here knows about executors or queues; these are the small,
operating-system-facing steps that every worker start goes through:

* ``start``: choosing the start method (``get_mp_context``,
  ``maybe_force_spawn``);
* ``names``: naming a worker (``worker_process_name``), showing that name in
  ``ps`` (``set_process_title``) and in front of everything it prints
  (``decorate_logs``);
* ``threads``: the thread-count environment a worker starts with
  (``worker_thread_env``), never left in the driver's environment;
* ``procs``: liveness (``process_gone``, ``open_pidfd``), process groups
  (``become_group_leader``, ``kill_process_group``), the parent-death signal,
  what a forked child inherited (``close_inherited_fds``) and CPU pinning
  (``apply_cpu_affinity``);
* ``topology`` (imported by name): the CPUs and NUMA nodes, and how a node's
  workers share them (``partition_cpus``).

This package never imports torch.  Where torch matters (CUDA already
initialised, the intra-op thread count) it looks at ``sys.modules`` and only
acts when the process has imported torch already.
"""

from mpexec.system.names import (
    PrefixedStream,
    decorate_logs,
    set_process_title,
    worker_process_name,
)
from mpexec.system.procs import (
    ProcStat,
    apply_cpu_affinity,
    become_group_leader,
    close_inherited_fds,
    kill_process_group,
    online_cpus,
    open_pidfd,
    proc_stat,
    process_gone,
    set_parent_death_signal,
    usable_cpus,
)
from mpexec.system.start import (
    START_METHODS,
    get_mp_context,
    maybe_force_spawn,
    running_thread_count,
)
from mpexec.system.threads import (
    THREAD_ENV_VARS,
    apply_thread_env_in_child,
    thread_vars,
    worker_thread_env,
)

__all__ = [
    "START_METHODS",
    "THREAD_ENV_VARS",
    "PrefixedStream",
    "ProcStat",
    "apply_cpu_affinity",
    "apply_thread_env_in_child",
    "become_group_leader",
    "close_inherited_fds",
    "decorate_logs",
    "get_mp_context",
    "kill_process_group",
    "maybe_force_spawn",
    "online_cpus",
    "open_pidfd",
    "proc_stat",
    "process_gone",
    "running_thread_count",
    "set_parent_death_signal",
    "set_process_title",
    "thread_vars",
    "usable_cpus",
    "worker_process_name",
    "worker_thread_env",
]
