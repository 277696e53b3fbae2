"""What every spec object is built on: strict, frozen models and the bounded numbers."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Base of every spec object: unknown keys are errors, values are frozen, no coercion
    of strings into numbers (``batch_size: "8"`` is a mistake, not 8)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


class PackageSpec(Strict):
    """A spec object run through an optional package (a ``logging:`` tracker):
    ``package``, the module and the extra that installs it, must be installed."""

    package: ClassVar[str] = ""

    @model_validator(mode="after")
    def _installed(self) -> PackageSpec:
        need_package(self.package, self.package)
        return self


def need_package(module: str, extra: str) -> None:
    """A logging target whose package is missing is a mistake in the file, found before
    the run starts, not an ImportError at its first iteration."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"needs the {module!r} package, which is not installed: "
                         f"pip install 'rlhfflow[{extra}]'")


PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
