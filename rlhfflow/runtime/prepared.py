"""What the coordinator readies before any worker is needed: ``prepare_run`` reads the
prompts (a bad prompts file stops the run before any cluster work), opens the buffer and
works out the models' configs. It needs no backend, so ``run_pipeline`` runs it on a
thread while the embedded cluster starts; the ``Executor`` is then built once, whole,
from its ``PreparedRun`` and the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfflow.config.pipeline import Pipeline
from rlhfflow.data.source import PromptSource
from rlhfflow.engine.resident import ModelConfig
from rlhfflow.runtime.checkpointing import CorruptCheckpoint, models_from_checkpoint
from rlhfflow.runtime.failures import RunError
from rlhfflow.runtime.models import after_setup, model_configs, tiny_models
from rlhfflow.runtime.runstate import StartPoint
from rlhfflow.storage import Checkpoint, ExperienceBuffer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRun:
    """A run ready for its backend.

    Attributes:
        pipeline: the pipeline (after the planner's choice, if it chose).
        out: the output directory.
        start: where the run starts (``runstate.prepare_output``).
        source: the prompt stream, or None for a run without loop iterations.
        buffer: the experience buffer, or None likewise.
        initial_models: each model's config before the loop (after the setup stages on
            a resume).
        models: ``initial_models`` with the loop-trained ones taken from the start's
            checkpoint.
        tiny: the ``tiny:`` models a worker builds (``models.tiny_models``).
    """

    pipeline: Pipeline
    out: Path
    start: StartPoint
    source: PromptSource | None
    buffer: ExperienceBuffer | None
    initial_models: dict[str, ModelConfig]
    models: dict[str, ModelConfig]
    tiny: dict[str, dict[str, Any]]


def prepare_run(pipeline: Pipeline, out: Path, start: StartPoint | None = None,
                progress: bool = True) -> PreparedRun:
    """The prompts, the buffer and the models' configs of ``pipeline`` writing to
    ``out`` from ``start`` (default: a fresh start); ``tiny:`` models are built later,
    by a worker. Says (``progress``) how many bad prompts were skipped."""
    start = start or StartPoint(None, resumed=False)
    graph = pipeline.graph
    source = buffer = None
    if graph.loop_stages and pipeline.spec.iterations > 0:
        generate_model = graph.nodes[graph.generators()[0]].model
        source = PromptSource.from_pipeline(pipeline, generate_model, kept=pipeline.prompts)
        _list_skipped_prompts(source, out, progress)
        buffer = ExperienceBuffer(out / "buffer.zarr")
    tiny = tiny_models(pipeline, out)
    initial = model_configs(pipeline, out, build=False)
    if start.checkpoint is not None:
        initial = after_setup(pipeline, out, initial)
    models = loop_models(pipeline, initial, start.checkpoint)
    return PreparedRun(pipeline, out, start, source, buffer, initial, models, tiny)


def loop_models(pipeline: Pipeline, models: Mapping[str, ModelConfig],
                checkpoint: Checkpoint | None) -> dict[str, ModelConfig]:
    """``models`` with those trained in the loop taken from ``checkpoint``."""
    try:
        return models_from_checkpoint(models, pipeline.graph.loop_trained(), checkpoint)
    except CorruptCheckpoint as exc:
        raise RunError(str(exc)) from None


def _list_skipped_prompts(source: PromptSource, out: Path, progress: bool) -> None:
    if source.skipped:
        listing = out / "skipped_prompts.txt"
        listing.write_text("\n".join(source.skipped) + "\n", encoding="utf-8")
        if progress:
            logger.info(f"rlhfflow: skipped {len(source.skipped)} bad prompt(s) "
                        f"(data.on_bad_prompt: skip), listed in {listing}; first: "
                        f"{source.skipped[0]}")
