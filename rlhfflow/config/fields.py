"""What every spec object is built on: strict, frozen models and the bounded numbers."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    """Base of every spec object: unknown keys are errors, values are frozen, no coercion
    of strings into numbers (``batch_size: "8"`` is a mistake, not 8)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
