"""The pipeline: the YAML spec, the stage graph, and the Dask dataflow executor.

The names below are imported on first use: importing a light module of the package
(``rlhfflow.pipeline.forkserver``) must not import torch and the stages first."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhfflow.pipeline.graph import SOURCE, StageGraph, StageNode
    from rlhfflow.pipeline.loader import Pipeline, load_pipeline
    from rlhfflow.pipeline.spec import PipelineSpec, SpecError

_HOMES = {"SOURCE": "graph", "StageGraph": "graph", "StageNode": "graph",
          "Pipeline": "loader", "load_pipeline": "loader",
          "PipelineSpec": "spec", "SpecError": "spec"}

__all__ = ["SOURCE", "Pipeline", "PipelineSpec", "SpecError", "StageGraph", "StageNode",
           "load_pipeline"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
