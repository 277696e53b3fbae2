"""Training stages: ``train_actor`` (the policy loss ``algorithm.policy_loss`` names in
the ops registry: PPO's clipped surrogate by default, GSPO with sequence-level ratios),
``train_critic`` (clipped value loss), and the stages run once before the loop: ``sft``
and ``reward_model`` (pairwise Bradley-Terry). Each returns metrics, not columns, and bumps the model version.

Models stay in eval mode while training (dropout off), as is usual in RLHF: the log-probs
of the update must match those the rollout was scored with.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from rlhfflow import ops
from rlhfflow.data.records import DataError, encode_prompts, encode_responses
from rlhfflow.engine.batch import Batch, concat_batches, score_valid
from rlhfflow.engine.forward import (
    response_logits,
    response_logprobs,
    response_values,
)
from rlhfflow.sdk import RESPONSE_INPUTS, PlanHints, StageContext, register_stage
from rlhfflow.stages.trainers import (
    OnceParams,
    OnceTrainer,
    Trainer,
    TrainParams,
    loss_mask_of,
    resolve_path,
    take_rows,
)
from rlhfflow.storage import ExperienceBuffer


class TrainActorParams(TrainParams):
    """``TrainParams``, and where the behaviour policy's log-probs come from."""

    old_logprobs: Literal["auto", "old_logprobs", "sample_logprobs"] = Field(
        "auto", description="the column of the sampling policy's log-probs the ratio "
                            "divides by: old_logprobs (a logprob stage recomputes them), "
                            "sample_logprobs (generate's own, computed while sampling: one "
                            "forward pass fewer), or auto: old_logprobs when a stage writes "
                            "them, else the sample_logprobs of a generate stage on the "
                            "same model")


def behaviour_column(params: TrainActorParams, written: Collection[str]) -> str:
    """The column ``params.old_logprobs`` names, given the columns ``written`` upstream:
    ``auto`` is ``old_logprobs`` where a stage wrote them, else ``sample_logprobs``."""
    if params.old_logprobs != "auto":
        return params.old_logprobs
    return "old_logprobs" if "old_logprobs" in written else "sample_logprobs"


#: The column the trainer adds under an off-policy correction (``before_steps``).
PROXIMAL = "proximal_logprobs"


def _kl_in_loss(algorithm) -> bool:
    return algorithm.kl_coef > 0 and algorithm.kl_in == "loss"


@register_stage
class TrainActorStage(Trainer):
    """Policy update of the actor: the policy loss ``algorithm.policy_loss`` names (PPO's
    clipped surrogate by default, token or sequence ratios, optionally dual-clip), optional
    KL to the reference in the loss, optional entropy bonus, all aggregated with
    ``algorithm.loss_agg``. Every stat the policy loss returns becomes a metric."""

    type_name = "train_actor"
    model_head = "lm"
    Params = TrainActorParams

    @classmethod
    def reads(cls, params, algorithm, has_model):
        # "auto" is settled by the loader (resolve_params); unsettled, it means a stage
        # that recomputes them
        column = "old_logprobs" if params.old_logprobs == "auto" else params.old_logprobs
        cols = [*RESPONSE_INPUTS, "score_valid", column, "advantages", "policy_version"]
        return tuple(cols + (["ref_logprobs"] if _kl_in_loss(algorithm) else []))

    @classmethod
    def resolve_params(cls, params, model, writers):
        # recomputed log-probs where the pipeline has them (what it asked for); else the
        # generator's own, when it samples from the model trained here (the behaviour
        # policy, whose log-probs the ratio divides by); else the read names
        # old_logprobs and the loader says no stage writes them
        if params.old_logprobs != "auto":
            return params
        own = model is not None and model in writers.get("sample_logprobs", ())
        column = "sample_logprobs" if own and "old_logprobs" not in writers \
            else "old_logprobs"
        return params.model_copy(update={"old_logprobs": column})

    def _agg(self) -> str:
        return self.algorithm.loss_agg

    def before_steps(self, resident, batch: Batch, ctx: StageContext) -> Batch:
        """With an off-policy correction, the proximal policy's log-probs: the model's
        before this iteration's first step (AReaL's decoupled PPO recomputes them in the
        trainer), whatever version sampled the rows; computed without gradients, a
        minibatch's rows at a time. With one step an iteration (``_one_step``) none is
        computed here: the loss takes them from its own forward."""
        if not self.algorithm.off_policy.on or self._one_step(resident):
            return batch
        rows = len(batch["response_ids"])
        size = max(1, -(-rows // self.params.minibatches))
        parts = []
        with torch.no_grad(), resident.generating():
            for start in range(0, rows, size):
                part = {k: v[start:start + size] for k, v in batch.items()}
                parts.append(response_logprobs(resident.module, part,
                                               ctx.settings.temperature))
        return {**batch, PROXIMAL: torch.cat(parts)}

    def _one_step(self, resident) -> bool:
        """Whether the iteration takes one optimizer step (one epoch of one minibatch)
        on a model without dropout: its forward then runs on the weights before the step,
        the proximal policy's, and its log-probs, detached, are the proximal ones (as
        TRL's ``old_per_token_logps`` with one step a generation), a no-grad forward of
        the batch fewer."""
        return self.params.epochs == 1 and self.params.minibatches == 1 and not any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in resident.module.modules())

    def loss(self, resident, batch, ctx, counts=None):
        algo = self.algorithm
        agg, divisor = algo.loss_agg, self._divisor(counts)
        mask = loss_mask_of(batch)
        temperature = ctx.settings.temperature
        if algo.entropy_coef > 0:  # the entropy needs the logits themselves
            logits = response_logits(resident.module, batch, temperature)
            logprobs = ops.logprobs_from_logits(logits, batch["response_ids"]) \
                * batch["response_mask"]
        else:  # the same log-probs (0 on padding), without the whole batch's logits
            logprobs = response_logprobs(resident.module, batch, temperature)
        policy_loss = ops.resolve_policy_loss(algo.policy_loss)
        inputs = {"logprobs": logprobs,
                  "old_logprobs": batch[behaviour_column(self.params, batch)],
                  "advantages": batch["advantages"], "mask": mask, "agg": agg,
                  "count": divisor, "config": algo}
        correction: dict[str, float] = {}
        if algo.off_policy.on:  # the ratio against the proximal policy, weighted
            off = algo.off_policy
            proximal = batch[PROXIMAL] if PROXIMAL in batch else logprobs.detach()
            inputs["weights"], correction = ops.off_policy_weights(
                proximal, inputs["old_logprobs"], mask, off.correction, off.level,
                off.cap, off.low, off.high)
            inputs["old_logprobs"] = proximal
        loss, stats = ops.call(policy_loss, inputs)
        metrics = {"policy_loss": loss.item(), **stats, **correction}
        # the KL and entropy terms aggregate like the policy term (veRL, TRL), so a
        # seq-mean loss does not pair with a token-mean penalty
        if _kl_in_loss(algo):
            kl_tok = ops.kl(logprobs, batch["ref_logprobs"], algo.kl_estimator)
            kl = ops.aggregate_loss(kl_tok, mask, agg, divisor)
            loss = loss + algo.kl_coef * kl
            # kl_loss is the term as aggregated (a sum under token-sum); kl_mean stays a
            # per-token mean whatever loss_agg is, comparable across configs
            metrics["kl_loss"] = kl.item()
            metrics["kl_mean"] = ops.masked_mean(kl_tok.detach(), mask).item()
        if algo.entropy_coef > 0:
            entropy = ops.entropy(logits, mask, divisor, agg)
            loss = loss - algo.entropy_coef * entropy
            metrics["entropy"] = entropy.item()
        return loss, metrics


@register_stage
class DistillDraftStage(Trainer):
    """Online distillation of a draft model (``generate``'s ``draft_model``) towards the
    actor, on the responses the actor just sampled: next-token cross-entropy of the
    draft at the rollout temperature, so its acceptance follows the actor as RL moves it.

    Cross-entropy on the actor's samples is, in expectation over them, the forward KL
    ``KL(p_actor || q_draft)`` plus the actor's entropy (a constant for the draft), so it
    trains the same thing as a forward KL to the actor's distributions without the extra
    actor forward that KL needs. Forward KL (mass-covering) suits speculation: a draft
    token is accepted with probability ``sum min(p, q)``, which a draft that puts mass
    wherever the actor does keeps high. Samples whose score was skipped count too (they
    are still the actor's samples). The stage's ``model`` is the draft model (trainable);
    it trains the copy on its worker(s), where ``generate`` finds it."""

    type_name = "distill_draft"
    model_head = "lm"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return RESPONSE_INPUTS

    def loss(self, resident, batch, ctx, counts=None):
        mask = batch["response_mask"].float()
        temperature = ctx.settings.temperature
        logits = response_logits(resident.module, batch, temperature)
        logprobs = ops.logprobs_from_logits(logits, batch["response_ids"])
        divisor = counts["tokens"] if counts else None
        loss = ops.aggregate_loss(-logprobs, mask, "token-mean", divisor)
        # the draft's mean probability of the actor's token: a cheap proxy of acceptance
        agreement = ops.masked_mean(logprobs.detach().exp(), mask)
        return loss, {"distill_loss": loss.item(), "draft_token_prob": agreement.item()}


@register_stage
class TrainCriticStage(Trainer):
    """Critic update: clipped value loss against the GAE returns."""

    type_name = "train_critic"
    model_head = "value"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return (*RESPONSE_INPUTS, "score_valid", "values", "returns")

    def _agg(self) -> str:
        return self.algorithm.value_loss_agg

    def loss(self, resident, batch, ctx, counts=None):
        mask = loss_mask_of(batch)
        values = response_values(resident.module, batch)
        loss, stats = ops.value_loss(values, batch["values"], batch["returns"], mask,
                                     self.algorithm.value_clip, self._divisor(counts),
                                     self.algorithm.value_loss_agg)
        return loss, {"value_loss": loss.item(), "value_clip_frac": stats["value_clip_frac"]}


class SFTParams(OnceParams):
    """Supervised fine-tuning, on either ``data``: a JSONL file of ``{"prompt",
    "response"}`` records, or ``buffer``: an experience buffer (``buffer.zarr`` of an
    earlier run), taking the responses that scored at least ``min_score`` in its last
    ``last_iterations`` iterations (rejection-sampling fine-tuning). The loss covers
    response tokens only."""

    buffer: str | None = Field(None, description="an earlier run's buffer.zarr to take "
                                                 "responses from, instead of data")
    min_score: float | None = Field(None, description="with buffer: keep responses that "
                                                      "scored at least this")
    last_iterations: Annotated[int, Field(gt=0)] | None = Field(
        None, description="with buffer: only its last N iterations")


@register_stage
class SFTStage(OnceTrainer):
    """Supervised fine-tuning of a causal LM, once before the loop (a warm start), on a
    JSONL file or on the best responses of an experience buffer."""

    type_name = "sft"
    Params = SFTParams
    model_head = "lm"
    fields = ("prompt", "response")

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        if (params.data is None) == (params.buffer is None):
            return ("params", "give exactly one of 'data' (a JSONL file) or 'buffer' "
                              "(an experience buffer)")
        if params.buffer is not None:
            path = resolve_path(params.buffer, base_dir)
            if not path.is_dir():
                return ("params.buffer", f"experience buffer not found: {path}")
            return None
        return super().check_params(params, has_model, base_dir)

    def examples(self, resident, base_dir: Path, ctx: StageContext) -> Batch | list:
        if self.params.buffer is None:
            return super().examples(resident, base_dir, ctx)
        return buffer_examples(resolve_path(self.params.buffer, base_dir), self.params.min_score,
                               self.params.last_iterations)

    def loss(self, resident, examples):
        if isinstance(examples, dict):
            batch = examples
        else:
            tok = resident.tokenizer
            prompt_ids, prompt_mask = encode_prompts(tok, [r["prompt"] for r in examples],
                                                     self.params.max_prompt_tokens)
            response_ids, response_mask = encode_responses(
                tok, [r["response"] for r in examples], self.params.max_response_tokens)
            batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                     "response_ids": response_ids, "response_mask": response_mask}
        return sft_loss(resident.module, batch)


def sft_loss(module: torch.nn.Module, batch: Batch, count: float | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """The SFT loss of a batch: the negative log-likelihood of its response tokens, a
    token mean (over ``count`` tokens when given: a gang's shard of a minibatch)."""
    logprobs = response_logprobs(module, batch)
    mask = batch["response_mask"].to(logprobs.device).float()
    loss = -ops.aggregate_loss(logprobs, mask, "token-mean", count)
    # the metric is this batch's own mean (a gang's shards average back to the whole's)
    return loss, {"sft_loss": -ops.masked_mean(logprobs.detach(), mask).item()}


class TrainSFTParams(TrainParams):
    """Supervised fine-tuning in the loop, on the iteration's own responses."""

    selected: bool = Field(True, description="train only on the rows a select stage "
                                             "marked (the selected column); false: on "
                                             "every row with a valid score")


@register_stage
class TrainSFTStage(Trainer):
    """Supervised fine-tuning of the actor on the iteration's responses, every
    iteration: with a ``select`` stage before it, rejection-sampling / best-of-N fine-tuning
    (the ``sft`` stage's loss, on sampled instead of given responses)."""

    type_name = "train_sft"
    Params = TrainSFTParams
    model_head = "lm"

    @classmethod
    def plan_hints(cls, params) -> PlanHints:
        return replace(super().plan_hints(params),
                       row_filter="selected" if params.selected else None)

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return (*RESPONSE_INPUTS, "score_valid", "policy_version",
                *(("selected",) if params.selected else ()))

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        # only the kept rows take part: the others would cost a forward pass each and
        # count nothing
        keep = score_valid(batch)
        if self.params.selected:
            keep = keep & batch["selected"].bool()
        rows = torch.nonzero(keep).flatten()
        stats = super().run(take_rows({k: v for k, v in batch.items() if k != "selected"}, rows),
                            ctx)
        return {**stats, "rows_trained": int(len(rows))}

    def loss(self, resident, batch, ctx, counts=None):
        return sft_loss(resident.module, batch, counts["tokens"] if counts else None)


def buffer_examples(path: Path, min_score: float | None, last_iterations: int | None) -> Batch:
    """Prompt/response rows of the committed iterations of a buffer, filtered by score."""
    buffer = ExperienceBuffer(path, create=False)
    iterations = buffer.iterations()
    if last_iterations:
        iterations = iterations[-last_iterations:]
    if not iterations:
        raise DataError(f"{path}: the experience buffer has no complete iteration")
    columns = ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "scores"]
    parts = []
    for it in iterations:
        wanted = columns + (["score_valid"] if "score_valid" in buffer.columns(it) else [])
        data = {k: torch.from_numpy(v) for k, v in buffer.read(it, wanted).items()}
        keep = data.pop("score_valid", torch.ones(len(data["scores"]))).bool()
        if min_score is not None:
            keep &= data["scores"] >= min_score
        parts.append({k: v[keep] for k, v in data.items() if k != "scores"})
    batch = concat_batches(_left_align(parts))
    if not len(batch["response_ids"]):
        raise DataError(f"{path}: no response scored at least min_score={min_score}")
    return batch


def _left_align(parts: list[Batch]) -> list[Batch]:
    """Prompts are left-padded per iteration: pad them on the left to one width."""
    width = max(p["prompt_ids"].shape[1] for p in parts)
    for p in parts:
        extra = width - p["prompt_ids"].shape[1]
        if extra:
            p["prompt_ids"] = F.pad(p["prompt_ids"], (extra, 0))
            p["prompt_mask"] = F.pad(p["prompt_mask"], (extra, 0))
    return parts


class RewardModelParams(OnceParams):
    """Pairwise reward-model training on a JSONL file of ``{"prompt", "chosen",
    "rejected"}`` records."""


@register_stage
class RewardModelStage(OnceTrainer):
    """Bradley-Terry reward model: ``-log sigmoid(r(chosen) - r(rejected))``, once before
    the loop. Scores are the value head at the last token of prompt + response."""

    type_name = "reward_model"
    Params = RewardModelParams
    model_head = "value"
    fields = ("prompt", "chosen", "rejected")

    def loss(self, resident, records):
        chosen = self._scores(resident, [r["prompt"] + r["chosen"] for r in records])
        rejected = self._scores(resident, [r["prompt"] + r["rejected"] for r in records])
        margin = chosen - rejected
        loss = -F.logsigmoid(margin).mean()
        return loss, {"rm_loss": loss.item(), "rm_accuracy": float((margin > 0).float().mean())}

    def _scores(self, resident, texts: list[str]) -> torch.Tensor:
        from rlhfflow.engine.models import sequence_scores

        # the same tokenization the score stage uses, so training and scoring agree
        enc = resident.tokenizer(texts, return_tensors="pt", padding=True,
                                 add_special_tokens=False)
        limit = self.params.max_prompt_tokens + self.params.max_response_tokens
        return sequence_scores(resident.module, enc["input_ids"][:, :limit].to(resident.device),
                               enc["attention_mask"][:, :limit].to(resident.device))

