"""Reusable stages and their registry. A stage knows nothing of Dask.

Importing this package registers the built-in stage types:
``generate``, ``logprob``, ``values``, ``score``, ``advantages``, ``train_actor``,
``train_critic``, ``sft``, ``reward_model``.
"""

from rlhfflow.stages import advantages, generate, inference, train  # noqa: F401  (registers)
from rlhfflow.stages.base import (
    SOURCE_COLUMNS,
    STAGE_TYPES,
    Batch,
    Column,
    Stage,
    StageContext,
    StageParams,
    concat_batches,
    create_stage,
    get_stage_type,
    register_stage,
    slice_batch,
)
from rlhfflow.stages.resident import ModelConfig, ModelStore, ResidentModel

__all__ = [
    "SOURCE_COLUMNS", "STAGE_TYPES", "Batch", "Column", "ModelConfig", "ModelStore",
    "ResidentModel", "Stage", "StageContext", "StageParams", "concat_batches",
    "create_stage", "get_stage_type", "register_stage", "slice_batch",
]
