"""Stages over preferences between responses: ``select`` (best-of-N: keep the best scored
responses of each prompt), ``train_dpo`` (offline DPO, once, from a preferences file) and
``train_dpo_online`` (DPO every iteration on pairs of the iteration's own responses).

Both DPO stages compute the same loss (``ops.dpo_loss``) on the same layout of pairs: a
prompt (left-padded), its chosen and rejected responses (right-padded, one width) and their
summed log-probs under the frozen reference.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field

from rlhfflow import ops
from rlhfflow.data.records import DataError, encode_prompts, encode_responses, read_jsonl
from rlhfflow.engine.batch import score_valid
from rlhfflow.engine.forward import response_logprobs
from rlhfflow.sdk import (
    RESPONSE_INPUTS,
    Batch,
    Column,
    PlanHints,
    Stage,
    StageContext,
    StageParams,
    register_stage,
)
from rlhfflow.stages.trainers import OnceParams, OnceTrainer, Trainer, TrainParams, resolve_path


class SelectParams(StageParams):
    """Which responses of each prompt to keep."""

    top_k: Annotated[int, Field(gt=0, description="responses kept per prompt, the best "
                                                  "scored first (ties: the earlier row)")] = 1
    min_score: float | None = Field(None, description="keep only responses scoring at "
                                                      "least this (none: no threshold)")


@register_stage
class SelectStage(Stage):
    """Best-of-N selection: marks the ``top_k`` best scored responses of each prompt
    (optionally only those above ``min_score``) in the ``selected`` column, for a
    training stage (``train_sft``) to learn from."""

    type_name = "select"
    Params = SelectParams
    per_batch = True  # a prompt's samples may sit in different micro-batches

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return ("scores", "score_valid", "group_ids")

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"selected": Column("int8")}

    @classmethod
    def plan_hints(cls, params) -> PlanHints:
        return replace(super().plan_hints(params), kept_per_prompt=params.top_k)

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        keep = ops.best_in_group(batch["scores"], batch["group_ids"], score_valid(batch),
                                 self.params.top_k, self.params.min_score)
        return {"selected": keep.to(torch.int8)}


class DPOParams(StageParams):
    """The DPO loss's settings, shared by the offline and the online stage."""

    beta: Annotated[float, Field(gt=0, description="DPO's beta: the strength of the "
                                                   "pull towards the reference")] = 0.1
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5, description="assumed "
                               "probability that a pair's preference is flipped "
                               "(conservative DPO); 0: plain DPO")] = 0.0


def dpo_pair_loss(module: torch.nn.Module, pairs: Batch, params: DPOParams,
                  temperature: float = 1.0, count: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """The DPO loss of a batch of pairs and its metrics.

    ``pairs`` holds ``prompt_ids``/``prompt_mask`` ``[P, Lp]``, ``chosen_ids``/
    ``chosen_mask`` and ``rejected_ids``/``rejected_mask`` ``[P, Lr]``, and
    ``ref_chosen``/``ref_rejected`` ``[P]`` (summed reference log-probs). Chosen and
    rejected go through the model as one batch. ``count`` is the divisor of the mean
    (a gang's shard of a minibatch passes the minibatch's pairs)."""
    both = {"prompt_ids": pairs["prompt_ids"].repeat(2, 1),
            "prompt_mask": pairs["prompt_mask"].repeat(2, 1),
            "response_ids": torch.cat([pairs["chosen_ids"], pairs["rejected_ids"]]),
            "response_mask": torch.cat([pairs["chosen_mask"], pairs["rejected_mask"]])}
    logps = response_logprobs(module, both, temperature).sum(-1)
    chosen, rejected = logps.chunk(2)
    losses, chosen_rewards, rejected_rewards = ops.dpo_loss(
        chosen, rejected, pairs["ref_chosen"].to(logps.device),
        pairs["ref_rejected"].to(logps.device), params.beta, params.label_smoothing)
    loss = losses.sum() / (count if count else max(len(losses), 1))
    margin = chosen_rewards - rejected_rewards
    return loss, {"dpo_loss": float(losses.detach().mean()),
                  "reward_margin": float(margin.mean()),
                  "reward_accuracy": float((margin > 0).float().mean()),
                  "chosen_reward": float(chosen_rewards.mean()),
                  "rejected_reward": float(rejected_rewards.mean())}


class TrainDPOParams(OnceParams, DPOParams):
    """Offline DPO on a JSONL file of ``{"prompt", "chosen", "rejected"}`` records."""

    ref: str = Field("ref", description="the frozen reference model (an lm model of "
                                        "'models' with the actor's tokenizer)")


@register_stage
class TrainDPOStage(OnceTrainer):
    """Offline DPO (Rafailov et al., 2023): trains the stage's model once, before the
    loop, on a file of preference pairs, against the frozen ``ref`` model.

    The reference log-probs are computed inside the stage, once before the first step:
    a stage that runs once has no dataflow of micro-batches for a ``logprob`` stage to
    fill, and the reference is frozen, so one pass serves every epoch."""

    type_name = "train_dpo"
    Params = TrainDPOParams
    model_head = "lm"
    fields = ("prompt", "chosen", "rejected")

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        problem = super().check_params(params, has_model, base_dir)
        if problem:
            return problem
        try:  # a bad record stops the pipeline before anything starts
            read_jsonl(resolve_path(params.data, base_dir), cls.fields)
        except DataError as exc:
            return ("params.data", str(exc))
        return None

    @classmethod
    def auxiliary_models(cls, params):
        return {"params.ref": params.ref}

    def examples(self, resident, base_dir: Path, ctx: StageContext) -> Batch:
        records = read_jsonl(resolve_path(self.params.data, base_dir), self.fields)
        tok = resident.tokenizer
        prompt_ids, prompt_mask = encode_prompts(tok, [r["prompt"] for r in records],
                                                 self.params.max_prompt_tokens)
        # one call for both sides: chosen and rejected get one width
        ids, mask = encode_responses(tok, [r["chosen"] for r in records] +
                                     [r["rejected"] for r in records],
                                     self.params.max_response_tokens)
        pairs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
        pairs["chosen_ids"], pairs["rejected_ids"] = ids.chunk(2)
        pairs["chosen_mask"], pairs["rejected_mask"] = mask.chunk(2)
        ref = ctx.models.get(self.params.ref)
        with torch.no_grad():
            for side in ("chosen", "rejected"):
                batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                         "response_ids": pairs[f"{side}_ids"],
                         "response_mask": pairs[f"{side}_mask"]}
                pairs[f"ref_{side}"] = response_logprobs(ref.module, batch).sum(-1).cpu()
        return pairs

    def loss(self, resident, pairs):
        return dpo_pair_loss(resident.module, pairs, self.params)


class TrainDPOOnlineParams(TrainParams, DPOParams):
    """Online DPO: pairs from the iteration's own scored responses."""


@register_stage
class TrainDPOOnlineStage(Trainer):
    """Online DPO: every iteration, pairs each prompt's best and worst scored response
    (``ops.preference_pairs``; prompts whose responses all score the same are skipped
    and counted as ``ties``) and takes DPO steps on the pairs. The reference log-probs
    come from a ``logprob`` stage on the reference model (``output: ref_logprobs``), so
    they are computed per micro-batch in the dataflow, beside scoring."""

    type_name = "train_dpo_online"
    Params = TrainDPOOnlineParams
    model_head = "lm"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return (*RESPONSE_INPUTS, "scores", "score_valid", "group_ids", "ref_logprobs",
                "policy_version")

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        chosen, rejected, ties = ops.preference_pairs(batch["scores"], batch["group_ids"],
                                                      score_valid(batch))
        pairs = {"prompt_ids": batch["prompt_ids"][chosen],
                 "prompt_mask": batch["prompt_mask"][chosen],
                 "chosen_ids": batch["response_ids"][chosen],
                 "chosen_mask": batch["response_mask"][chosen],
                 "rejected_ids": batch["response_ids"][rejected],
                 "rejected_mask": batch["response_mask"][rejected],
                 "ref_chosen": batch["ref_logprobs"][chosen].sum(-1),
                 "ref_rejected": batch["ref_logprobs"][rejected].sum(-1),
                 "policy_version": batch["policy_version"][chosen]}
        stats = super().run(pairs, ctx)
        return {**stats, "pairs": int(len(chosen)), "ties": ties}

    def loss_mask(self, batch):
        return torch.ones(len(batch["chosen_ids"]), 1)  # the loss is a mean over pairs

    def loss(self, resident, batch, ctx, counts=None):
        temperature = ctx.settings.temperature
        return dpo_pair_loss(resident.module, batch, self.params, temperature,
                             counts["tokens"] if counts else None)
