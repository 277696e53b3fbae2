"""Storage: zarr v3 experience buffers and the JSONL metrics log.

Imports neither dask nor other rlhfflow packages, so any process (coordinator, Dask
worker, CLI) can use it cheaply.
"""

from rlhfflow.storage.buffer import (
    ColumnSpec,
    ExperienceBuffer,
    IterationNotFoundError,
    group_name,
    split_rows,
)
from rlhfflow.storage.bufferwrites import COMMIT_KEY
from rlhfflow.storage.checkpoints import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    link_model,
)
from rlhfflow.storage.metrics import MetricsLog, to_jsonable

__all__ = [
    "COMMIT_KEY",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "ColumnSpec",
    "ExperienceBuffer",
    "IterationNotFoundError",
    "MetricsLog",
    "group_name",
    "link_model",
    "split_rows",
    "to_jsonable",
]
