"""Reusable stages and their registry. A stage knows nothing of Dask.

Importing this package registers the built-in stage types:
``generate``, ``logprob``, ``values``, ``score``, ``advantages``, ``train_actor``,
``train_critic``, ``distill_draft``, ``sft``, ``reward_model``, ``remax_baseline``,
``select``, ``train_sft``, ``train_dpo``, ``train_dpo_online``, ``evaluate``,
``rollout``. Installed
packages add types through the ``rlhfflow.stages`` entry-point group (``load_plugins``),
and a pipeline may name any ``Stage`` subclass by import path (``resolve_stage_type``).
"""

from rlhfflow.engine.batch import Batch, concat_batches, slice_batch
from rlhfflow.engine.resident import ModelConfig, ModelStore, ResidentModel
from rlhfflow.stages import (  # noqa: F401  (registers)
    advantages,
    evaluate,
    generate,
    inference,
    preference,
    rollout,
    train,
)
from rlhfflow.stages.base import (
    BROKEN_PLUGINS,
    ENTRY_POINT_GROUP,
    PLUGIN_SOURCES,
    SOURCE_COLUMNS,
    STAGE_TYPES,
    Column,
    RunSettings,
    Stage,
    StageContext,
    StageParams,
    StageTypeError,
    create_stage,
    get_stage_type,
    known_stage_types,
    load_plugins,
    register_stage,
    resolve_stage_type,
    stage_type_path,
)

__all__ = [
    "BROKEN_PLUGINS", "ENTRY_POINT_GROUP", "PLUGIN_SOURCES", "SOURCE_COLUMNS", "STAGE_TYPES",
    "Batch", "Column", "ModelConfig", "ModelStore", "ResidentModel", "RunSettings", "Stage", "StageContext",
    "StageParams", "StageTypeError", "concat_batches", "create_stage", "get_stage_type",
    "known_stage_types", "load_plugins", "register_stage", "resolve_stage_type",
    "slice_batch", "stage_type_path",
]
