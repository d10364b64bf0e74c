"""Workers as Ray actors in a placement group: the executor (``executor``), the
actor (``actor``), the Ray session and placement (``cluster``), the queues of
the shared-memory call path (``queues``) and the replies of the Ray call path
(``replies``).  Importing this package never imports Ray: the executor does,
when it starts.
"""

from mpexec.executor.ray.executor import RayExecutor

__all__ = ["RayExecutor"]
