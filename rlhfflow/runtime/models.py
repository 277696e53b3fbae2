"""The models of a run as the workers load them: each model's config, the ``tiny:``
models still to build, and where the setup stages and checkpoints move their weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from rlhfflow.config.loader import Pipeline
from rlhfflow.engine.models import save_tiny_model
from rlhfflow.engine.resident import ModelConfig


def tiny_models(pipeline: Pipeline, out: Path) -> dict[str, dict[str, Any]]:
    """The ``tiny:`` models still to build, by name: the keyword arguments of
    ``save_tiny_model`` (into OUT/models/NAME/init; a resumed run keeps its own)."""
    spec = pipeline.spec
    builds = {}
    for name, model in spec.models.items():
        path = out / "models" / name / "init"
        if model.tiny is not None and not (path / "config.json").is_file():
            tiny = model.tiny
            builds[name] = {"path": str(path), "head": model.head,
                            "seed": spec.seed if tiny.seed is None else tiny.seed,
                            "arch": tiny.arch, "n_layer": tiny.layers, "hidden": tiny.hidden,
                            "n_head": tiny.heads, "max_positions": tiny.max_positions}
    return builds


def model_configs(pipeline: Pipeline, out: Path, build: bool = True
                  ) -> dict[str, ModelConfig]:
    """Each model's config; ``tiny:`` models live in OUT/models/NAME/init, built here
    unless ``build`` is false (a run builds them on a worker: ``tiny_models``)."""
    spec = pipeline.spec
    if build:
        for kwargs in tiny_models(pipeline, out).values():
            save_tiny_model(**kwargs)
    paths: dict[str, str] = {}
    for name, model in spec.models.items():
        if model.tiny is not None:
            paths[name] = str(out / "models" / name / "init")
        elif model.path is not None:
            paths[name] = pipeline.model_source(model.path)
    return {name: ModelConfig(name=name, head=model.head,
                              init_path=paths[pipeline.model_root(name)],
                              trainable=model.trainable,
                              optimizer=model.optimizer.model_dump(), dtype=model.dtype,
                              gradient_checkpointing=model.gradient_checkpointing,
                              attn_implementation=model.attn_implementation,
                              lora={**model.lora.model_dump(), "seed": spec.seed}
                              if model.lora else None,
                              base_of=pipeline.lora_base(name))
            for name, model in spec.models.items()}


def setup_trained(pipeline: Pipeline) -> dict[str, str]:
    """Model -> the setup stage that trains it."""
    graph = pipeline.graph
    return {graph.nodes[n].model: n for n in graph.setup_stages}


def after_setup(pipeline: Pipeline, out: Path, models: dict[str, ModelConfig]
                ) -> dict[str, ModelConfig]:
    """Configs pointing every model trained by a setup stage, and every model copied
    ``from:`` one, at the weights the setup stage saved (OUTPUT/models/NAME/setup)."""
    trained = setup_trained(pipeline)
    updated = dict(models)
    for name in models:
        root = name if name in trained else pipeline.model_root(name)
        if root in trained:
            updated[name] = replace(models[name],
                                    init_path=str(out / "models" / root / "setup"))
    return updated
