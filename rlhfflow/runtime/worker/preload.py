"""What a device worker imports before its first task: torch, transformers' model
classes, zarr and the stages (~6 s with transformers 5 on a 2-core machine).

The embedded cluster's workers are forks of a server that ran :func:`warm` as it started
(``rlhfflow.runtime.worker.warm_imports``, see ``rlhfflow.launch.forkserver.start_fork_server``), beside the
coordinator's own imports; the coordinator also runs :func:`warm` as a task on each
worker (a no-op there) so a spawned worker imports before the models are installed.
A task, not a background thread: transformers resolves its names lazily and is not safe
to import from two threads at once (a background import raced a task's
``from transformers import AutoConfig``).

Workers you start yourself: ``dask worker SCHEDULER --preload
rlhfflow.runtime.worker.warm_imports`` imports all of it as the worker starts.
"""

from __future__ import annotations

import time


def warm() -> float:
    """Import what the stages need; returns the seconds it took."""
    start = time.perf_counter()
    import rlhfflow.runtime.worker.tasks  # noqa: F401  (torch, distributed, every built-in stage)
    import rlhfflow.storage  # noqa: F401  (zarr)

    try:  # transformers imports model code on first use: the Llama family's now
        import transformers.models.llama.modeling_llama  # noqa: F401
    except ImportError:  # a transformers without it: the first task imports what it needs
        pass
    return time.perf_counter() - start
