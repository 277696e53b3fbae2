"""The embedded cluster's worker process as it starts: a Dask worker preload
(``distributed.worker.preload``, set by ``local_cluster``), run before the worker takes
any task.

A worker forked from a warm server takes the nice value, CPU affinity, resource limits and
umask of the command that started the run (``rlhfflow.launch.caller``), every thread of
it; a cold run's workers have them already.
"""

from __future__ import annotations

from typing import Any

from rlhfflow.launch.caller import apply_from_environment


def dask_setup(worker: Any) -> None:
    """Dask's preload hook: called once as the worker starts."""
    apply_from_environment()
