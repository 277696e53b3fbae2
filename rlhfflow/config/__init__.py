"""What the user wrote: the YAML spec, the loaded pipeline and its stage graph.

The names below are imported on first use, so that importing one light module of the
package (``rlhfflow.config.spec``) does not import torch and the stages first."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhfflow.config.graph import SOURCE, StageGraph, StageNode
    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.config.pipeline import Pipeline
    from rlhfflow.config.spec import PipelineSpec
    from rlhfflow.errors import SpecError

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
