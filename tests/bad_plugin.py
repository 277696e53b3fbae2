"""Plugin stage types named by import path in tests (``tests.bad_plugin:...``): two that
declare their columns wrongly, one that settles its params badly, three that declare
iteration metrics badly, and a generator that is not the built-in ``generate``."""

from __future__ import annotations

from rlhfflow.stages import Column, IterationMetric, Stage
from rlhfflow.stages.generate import GenerateStage


class BadColumns(Stage):
    """Declares a column the experience buffer cannot store."""

    type_name = "bad_columns"

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"bonus": Column("object")}


class Raises(Stage):
    """A plugin whose ``reads`` raises."""

    type_name = "raises"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        raise RuntimeError("broken")


class BadResolve(Stage):
    """A plugin whose ``resolve_params`` returns something other than its params."""

    type_name = "bad_resolve"

    @classmethod
    def resolve_params(cls, params, model, writers):
        return {"settled": True}


class TakenMetric(Stage):
    """Declares a figure under a name the advantages stage declares (``kl_mean``)."""

    type_name = "taken_metric"

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"bonus": Column("float32")}

    @classmethod
    def iteration_metrics(cls, params):
        return (IterationMetric("kl_mean", "bonus"),)


class RuntimeMetric(TakenMetric):
    """Declares a figure the runtime computes itself (``reward_mean``)."""

    type_name = "runtime_metric"

    @classmethod
    def iteration_metrics(cls, params):
        return (IterationMetric("reward_mean", "bonus"),)


class RatioOfNothing(TakenMetric):
    """Declares a ratio without the column it divides by."""

    type_name = "ratio_of_nothing"

    @classmethod
    def iteration_metrics(cls, params):
        return (IterationMetric("bonus_rate", "bonus", "ratio"),)


class MyGenerator(GenerateStage):
    """A plugin generator: a subclass that the runtime knows only by ``generates``."""

    type_name = "my_generator"


class Fails(Stage):
    """A plugin whose ``run`` raises: ``rlhfflow stage test`` shows the traceback."""

    type_name = "fails"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return ("scores",)

    def run(self, batch, ctx):
        raise ZeroDivisionError("the plugin divided by zero")
