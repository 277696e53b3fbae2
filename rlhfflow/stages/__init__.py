"""The built-in stage types. Importing this package registers them:
``generate``, ``logprob``, ``values``, ``score``, ``advantages``, ``train_actor``,
``train_critic``, ``distill_draft``, ``sft``, ``reward_model``, ``remax_baseline``,
``select``, ``train_sft``, ``train_dpo``, ``train_dpo_online``, ``evaluate``,
``rollout``. Each module holds stage types only; what they share lives in the engine
(``rlhfflow.engine``: decoding, episodes, reward-function calls, user code) or in
``rlhfflow.stages.trainers`` (the training loop the trainers build on).

The stage SDK (``Stage``, ``StageParams``, ``register_stage``, ...) is ``rlhfflow.sdk``;
its names are re-exported here so that plugins written against ``rlhfflow.stages``
keep working.
"""

from rlhfflow.engine.batch import concat_batches, slice_batch
from rlhfflow.engine.resident import ModelConfig, ModelStore, ResidentModel
from rlhfflow.sdk import (
    BROKEN_PLUGINS,
    ENTRY_POINT_GROUP,
    PLUGIN_SOURCES,
    RESPONSE_INPUTS,
    SOURCE_COLUMNS,
    STAGE_TYPES,
    Batch,
    Column,
    IterationMetric,
    PlanHints,
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
from rlhfflow.stages import (  # noqa: F401  (registers)
    advantages,
    evaluate,
    generate,
    inference,
    preference,
    rollout,
    train,
)

__all__ = [
    "BROKEN_PLUGINS", "ENTRY_POINT_GROUP", "PLUGIN_SOURCES", "RESPONSE_INPUTS",
    "SOURCE_COLUMNS", "STAGE_TYPES", "Batch", "Column", "IterationMetric", "ModelConfig",
    "ModelStore", "PlanHints", "ResidentModel", "RunSettings", "Stage", "StageContext",
    "StageParams", "StageTypeError", "concat_batches", "create_stage", "get_stage_type",
    "known_stage_types", "load_plugins", "register_stage", "resolve_stage_type",
    "slice_batch", "stage_type_path",
]
