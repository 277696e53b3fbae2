"""``length_penalty``: scores minus a penalty per response token over a budget."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from rlhfflow.sdk import Batch, Column, Stage, StageContext, StageParams


class LengthPenaltyParams(StageParams):
    """How long a response may be before it costs, and what each extra token costs."""

    budget: Annotated[int, Field(ge=0, description="response tokens that cost nothing")] = 8
    per_token: Annotated[float, Field(ge=0, description="penalty per token over the "
                                                        "budget")] = 0.05
    output: str = Field("penalized_scores", description="the column to write")


class LengthPenalty(Stage):
    """Scores minus ``per_token`` for every response token beyond ``budget``."""

    type_name = "length_penalty"
    Params = LengthPenaltyParams

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return ("scores", "response_mask")

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {params.output: Column("float32")}

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        lengths = batch["response_mask"].sum(-1).float()
        over = (lengths - self.params.budget).clamp(min=0)
        scores = batch["scores"].float() - self.params.per_token * over
        return {self.params.output: scores}
