"""The stage abstraction: a reusable unit with declared inputs, outputs and parameters.

A stage reads named columns of a batch (a ``dict`` of tensors with one row per sample),
computes, and returns new columns. It knows nothing of Dask: the executor decides where
and when it runs, and the same stage runs alone from Python::

    from rlhfflow.stages import create_stage, ModelStore, StageContext
    stage = create_stage("generate", params={"max_new_tokens": 8}, model="actor")
    out = stage.run(batch, StageContext(iteration=0, seed=0, models=store))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

Batch = dict[str, Any]
"""Columns of a (micro-)batch: tensors with the row dimension first, or lists of str."""


class StageParams(BaseModel):
    """Base class of every stage's ``params``: strict, frozen, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Column:
    """A column a stage writes: dtype and per-row trailing shape.

    ``length`` is ``"prompt"``, ``"response"`` or ``None`` (one value per row); the
    executor resolves it to the prompt/response token length of the iteration.
    """

    dtype: str
    length: str | None = None


# Columns the data source provides for every row of every iteration.
SOURCE_COLUMNS: dict[str, Column] = {
    "prompt_ids": Column("int64", "prompt"),
    "prompt_mask": Column("int8", "prompt"),
    "prompt_index": Column("int64"),
    "sample_index": Column("int64"),
    "group_ids": Column("int64"),
    "prompt_text": Column("str"),
    # the record's other fields (answer, tests, ...) as a JSON object, for reward functions
    "prompt_fields": Column("str"),
}


@dataclass
class StageContext:
    """What a running stage may know about its surroundings.

    Attributes:
        iteration: the RLHF iteration (0-based); -1 for setup stages run once.
        seed: the pipeline seed; stages derive their randomness from it.
        models: where the stage finds resident models by name.
        algorithm: the pipeline's algorithm settings (``AlgorithmSpec``), or None.
        settings: extra values the pipeline resolves for stages (e.g. rollout temperature).
        gang: the data-parallel gang (``rlhfflow.stages.parallel.Gang``) a training stage
            runs in, or None when it trains alone.
    """

    iteration: int
    seed: int
    models: Any = None
    algorithm: Any = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    gang: Any = None


class Stage:
    """Base class of stages. Subclasses set the class attributes and implement ``run``.

    Class attributes:
        type_name: the registry name used in YAML (``type: generate``).
        Params: the pydantic model of ``params``.
        model_head: the head the stage's model must have (``"lm"``, ``"value"``), or
            None when the stage takes no model; ``model_optional`` allows either.
        trains: whether the stage updates its model's weights.
        once: whether the stage runs once before the iteration loop (SFT, reward model).
        per_batch: whether the stage needs the whole batch at once (advantages,
            training) rather than one micro-batch at a time.
    """

    type_name: ClassVar[str] = ""
    Params: ClassVar[type[StageParams]] = StageParams
    model_head: ClassVar[str | None] = None
    model_optional: ClassVar[bool] = False
    trains: ClassVar[bool] = False
    once: ClassVar[bool] = False
    per_batch: ClassVar[bool] = False

    def __init__(self, name: str, params: StageParams | Mapping[str, Any] | None = None,
                 algorithm: Any = None, model: str | None = None) -> None:
        self.name = name
        self.model = model
        if not isinstance(params, StageParams):
            params = self.Params(**(params or {}))
        self.params = params
        self.algorithm = algorithm

    @classmethod
    def reads(cls, params: StageParams, algorithm: Any, has_model: bool) -> tuple[str, ...]:
        """Columns the stage needs from upstream stages (or the data source)."""
        return ()

    @classmethod
    def writes(cls, params: StageParams, algorithm: Any, has_model: bool) -> dict[str, Column]:
        """Columns the stage adds to the batch, with their dtypes and shapes."""
        return {}

    @classmethod
    def check_params(cls, params: StageParams, has_model: bool, base_dir: Path
                     ) -> tuple[str, str] | None:
        """Checks that need more than the params schema (files, imports, the model).

        Returns ``(key, message)`` for the first problem (``key`` relative to the stage,
        e.g. ``"params.function"``), or None.
        """
        return None

    @classmethod
    def auxiliary_models(cls, params: StageParams) -> dict[str, str]:
        """Models the stage uses besides its own (``{key: model name}``, e.g. a draft
        model under ``"params.draft_model"``). The loader checks each is an ``lm`` model
        with the same tokenizer as the stage's model."""
        return {}

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        """Compute the stage's columns for ``batch``. Returns only the new columns."""
        raise NotImplementedError


STAGE_TYPES: dict[str, type[Stage]] = {}


def register_stage(cls: type[Stage]) -> type[Stage]:
    """Class decorator: make a stage type available to pipelines by its ``type_name``."""
    if not cls.type_name:
        raise ValueError(f"{cls.__name__} has no type_name")
    if cls.type_name in STAGE_TYPES and STAGE_TYPES[cls.type_name] is not cls:
        raise ValueError(f"stage type {cls.type_name!r} is registered twice")
    STAGE_TYPES[cls.type_name] = cls
    return cls


def get_stage_type(type_name: str) -> type[Stage]:
    """The stage class registered as ``type_name``; KeyError lists the known types."""
    try:
        return STAGE_TYPES[type_name]
    except KeyError:
        raise KeyError(f"unknown stage type {type_name!r}; known: "
                       f"{', '.join(sorted(STAGE_TYPES))}") from None


def create_stage(type_name: str, name: str | None = None,
                 params: Mapping[str, Any] | None = None, algorithm: Any = None,
                 model: str | None = None) -> Stage:
    """Instantiate a registered stage, validating ``params``."""
    cls = get_stage_type(type_name)
    return cls(name or type_name, params, algorithm, model)


def concat_batches(parts: list[Batch]) -> Batch:
    """Join micro-batches row-wise; tensors of different trailing lengths are right-padded."""
    if len(parts) == 1:
        return dict(parts[0])
    out: Batch = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if isinstance(values[0], torch.Tensor):
            out[key] = _cat_padded(values)
        else:
            out[key] = [v for part in values for v in part]
    return out


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dim() < 2 or len({t.shape[1:] for t in tensors}) == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
    return torch.cat(padded)


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``[start, stop)`` of every column."""
    return {k: v[start:stop] for k, v in batch.items()}
