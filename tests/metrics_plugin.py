"""A user's stage module, named by import path in tests (``tests.metrics_plugin:...``): a
stage that writes per-row columns and declares how they reduce into figures of each
iteration's record (``Stage.iteration_metrics``)."""

from __future__ import annotations

import torch

from rlhfflow.sdk import Batch, Column, IterationMetric, Stage, StageContext


def vowel_share(text: str) -> float | None:
    """The share of a response's letters that are vowels; None without letters."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else None


class VowelShare(Stage):
    """Writes each response's share of vowels (``vowel_share``; 0 without letters, which
    ``has_letters`` marks) and its count of vowels, and declares the iteration's mean
    share over the responses with letters and its total of vowels."""

    type_name = "vowel_share"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return ("response_text",)

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"vowel_share": Column("float32"), "has_letters": Column("int8"),
                "vowels": Column("int64")}

    @classmethod
    def iteration_metrics(cls, params):
        return (IterationMetric("vowel_share_mean", "vowel_share", where="has_letters"),
                IterationMetric("vowels_total", "vowels", "sum", digits=0))

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        shares = [vowel_share(t) for t in batch["response_text"]]
        return {"vowel_share": torch.tensor([s or 0.0 for s in shares]),
                "has_letters": torch.tensor([s is not None for s in shares],
                                            dtype=torch.int8),
                "vowels": torch.tensor([sum(c in "aeiou" for c in t.lower())
                                        for t in batch["response_text"]])}


class PromptLength(Stage):
    """Writes each prompt's length in characters: a stage that reads the prompts only."""

    type_name = "prompt_length"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return ("prompt_text",)

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"prompt_chars": Column("int64")}

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        return {"prompt_chars": torch.tensor([len(t) for t in batch["prompt_text"]])}
