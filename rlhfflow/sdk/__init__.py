"""The stage SDK: everything a plugin author needs to write a stage type, and nothing
else. It imports neither torch nor the built-in stage types (``rlhfflow.stages``); a test
keeps it so.

Write a stage by subclassing ``Stage`` (its ``Params``, ``reads``, ``writes``, ``run``),
register it with ``register_stage`` or the ``rlhfflow.stages`` entry-point group, or name
it by import path in the pipeline (``type: mypkg.stages:CodeReward``). The stage reference
(``rlhfflow stages``, ``docs/reference/stages.md``) is built from the classes
(``rlhfflow.sdk.reference``).
"""

from rlhfflow.sdk.registry import (
    BROKEN_PLUGINS,
    ENTRY_POINT_GROUP,
    PLUGIN_SOURCES,
    STAGE_TYPES,
    StageTypeError,
    create_stage,
    get_stage_type,
    known_stage_types,
    load_plugins,
    register_stage,
    resolve_stage_type,
    stage_type_path,
)
from rlhfflow.sdk.stage import (
    RESPONSE_INPUTS,
    RUN_METRICS,
    SOURCE_COLUMNS,
    Column,
    IterationMetric,
    PlanHints,
    RunSettings,
    Stage,
    StageContext,
    StageParams,
)
from rlhfflow.types import Batch

__all__ = [
    "BROKEN_PLUGINS", "ENTRY_POINT_GROUP", "PLUGIN_SOURCES", "RESPONSE_INPUTS", "RUN_METRICS",
    "SOURCE_COLUMNS", "STAGE_TYPES", "Batch", "Column", "IterationMetric", "PlanHints",
    "RunSettings", "Stage", "StageContext", "StageParams", "StageTypeError", "create_stage",
    "get_stage_type", "known_stage_types", "load_plugins", "register_stage",
    "resolve_stage_type", "stage_type_path",
]
