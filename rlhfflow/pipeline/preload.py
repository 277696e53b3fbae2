"""What a device worker imports before its first task: torch, transformers' model
classes, zarr and the stages take seconds to import. The coordinator runs :func:`warm`
as a task on each embedded worker as soon as the cluster is up, while it reads the
prompts and builds the models itself, so the imports are not on the run's critical path.

A task, not a Dask ``preload`` and not a background thread: transformers resolves its
names lazily and is not safe to import from two threads at once (a background import
raced a task's ``from transformers import AutoConfig``), and a preload makes every worker
start, a restarted one's too, wait for the imports. This module itself imports nothing
heavy, so a worker unpickles the task at once.
"""

from __future__ import annotations

import time


def warm() -> float:
    """Import what the stages need; returns the seconds it took."""
    start = time.perf_counter()
    import rlhfflow.pipeline.worker  # noqa: F401  (torch, distributed, every built-in stage)
    import rlhfflow.storage  # noqa: F401  (zarr)

    try:  # transformers imports model code on first use: the Llama family's now
        import transformers.models.llama.modeling_llama  # noqa: F401
    except ImportError:  # a transformers without it: the first task imports what it needs
        pass
    return time.perf_counter() - start
