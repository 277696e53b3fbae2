"""The pipeline: the YAML spec, the stage graph, and the Dask dataflow executor."""

from rlhfflow.pipeline.graph import SOURCE, StageGraph, StageNode
from rlhfflow.pipeline.loader import Pipeline, load_pipeline
from rlhfflow.pipeline.spec import PipelineSpec, SpecError

__all__ = ["SOURCE", "Pipeline", "PipelineSpec", "SpecError", "StageGraph", "StageNode",
           "load_pipeline"]
