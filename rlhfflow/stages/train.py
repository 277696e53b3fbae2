"""Training stages: ``train_actor`` (the policy loss ``algorithm.policy_loss`` names in
the ops registry: PPO's clipped surrogate by default, GSPO with sequence-level ratios),
``train_critic`` (clipped value loss), and the stages run once before the loop: ``sft``
and ``reward_model`` (pairwise Bradley-Terry). Each returns metrics, not columns, and bumps the model version.

Models stay in eval mode while training (dropout off), as is usual in RLHF: the log-probs
of the update must match those the rollout was scored with.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from rlhfflow import ops
from rlhfflow.data.records import DataError, encode_prompts, encode_responses, read_jsonl
from rlhfflow.engine.batch import Batch, concat_batches
from rlhfflow.engine.forward import (
    minibatch_indices,
    response_logits,
    response_logprobs,
    response_values,
    shared_prompt_rows,
    stage_seed,
)
from rlhfflow.engine.parallel import allreduce_sum
from rlhfflow.stages.advantages import score_valid
from rlhfflow.stages.base import Stage, StageContext, StageParams, register_stage
from rlhfflow.stages.inference import RESPONSE_INPUTS
from rlhfflow.storage import ExperienceBuffer


class TrainParams(StageParams):
    """Passes over the batch and optimizer steps per pass."""

    epochs: Annotated[int, Field(gt=0, description="passes over the iteration's batch")] = 1
    minibatches: Annotated[int, Field(gt=0, description="optimizer steps per pass (the "
                                                        "batch split evenly)")] = 1
    shuffle: bool = Field(True, description="shuffle the rows before each pass")


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


def _rows(batch: Batch, index: torch.Tensor) -> Batch:
    return {k: (v[index] if isinstance(v, torch.Tensor) else [v[i] for i in index.tolist()])
            for k, v in batch.items()}


def _rank_rows(batch: Batch, index: torch.Tensor, gang) -> torch.Tensor:
    """This gang rank's rows of the minibatch ``index``: whole groups of one prompt's
    samples (whose prompt it then runs once, ``response_logits``), dealt so that the
    ranks get about the same number of tokens, since the rank with the most decides when
    the gradient all-reduce can start. Every rank computes the same deal; the minibatch
    and its summed gradient are the same whichever rank takes a row."""
    groups = _prompt_groups(batch, index)
    if len(groups) < gang.size:  # too few groups to go round: near-equal row counts
        return index[gang.shard(len(index))]
    mask = batch.get("response_mask")
    tokens = mask[index].sum(-1).tolist() if mask is not None else [1] * len(index)
    prompt_tokens = batch["prompt_mask"][index].sum(-1).tolist() \
        if "prompt_mask" in batch else [0] * len(index)
    costs = [prompt_tokens[g[0]] + sum(tokens[r] for r in g) for g in groups]
    # longest processing time first: the largest group to the least loaded rank
    loads, mine = [0.0] * gang.size, []
    for g in sorted(range(len(groups)), key=lambda g: (-costs[g], groups[g][0])):
        rank = min(range(gang.size), key=lambda r: (loads[r], r))
        loads[rank] += costs[g]
        if rank == gang.rank:
            mine += groups[g]
    return index[sorted(mine)]


def _prompt_groups(batch: Batch, index: torch.Tensor) -> list[list[int]]:
    """Positions in ``index`` grouped by prompt (each row alone without prompts)."""
    if "prompt_ids" not in batch:
        return [[r] for r in range(len(index))]
    shared = shared_prompt_rows(batch["prompt_ids"][index], batch["prompt_mask"][index])
    if shared is None:
        return [[r] for r in range(len(index))]
    groups: list[list[int]] = [[] for _ in range(len(shared[0]))]
    for position, group in enumerate(shared[1].tolist()):
        groups[group].append(position)
    return groups


def _mean_metrics(history: list[dict[str, float]], weights: list[float] | None = None,
                  gang=None) -> dict[str, float]:
    """Mean of each metric over the steps, weighted by ``weights`` and taken over the
    whole gang (every rank gets the same numbers)."""
    keys = list(history[0]) if history else []
    weights = weights or [1.0] * len(history)
    sums = [sum(w * h[k] for h, w in zip(history, weights, strict=True)) for k in keys]
    totals = allreduce_sum([*sums, float(sum(weights))], gang)
    return {k: v / max(totals[-1], 1e-12) for k, v in zip(keys, totals, strict=False)}


_LOSS_TERMS = {"policy_loss", "kl_loss", "entropy", "value_loss"}


class _Trainer(Stage):
    """Shared loop: epochs x shuffled minibatches, one optimizer step per minibatch.

    In a data-parallel gang (``ctx.gang``) every rank sees the whole batch, draws the same
    minibatches and trains on its shard of each; losses are divided by the minibatch's
    own counts (``ops.loss_count``), so the summed gradients equal one worker's update
    on the whole minibatch. ``backend`` is ``"torch"`` or ``"deepspeed"`` (set by the
    executor from the stage's ``backend:``/``deepspeed:`` keys).
    """

    Params = TrainParams
    trains = True
    per_batch = True
    backend: str = "torch"
    deepspeed: Any = None

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        gang = ctx.gang
        if self.backend == "deepspeed" and resident.engine is None:
            options = self.deepspeed or {}
            resident.use_deepspeed(options.get("zero_stage", 2), options.get("config", {}),
                                   gang.rank if gang else 0)
        batch = {k: v.to(resident.device) for k, v in batch.items()
                 if isinstance(v, torch.Tensor)}
        rows = len(next(iter(batch.values()))) if batch else 0
        gen = torch.Generator().manual_seed(stage_seed(ctx.seed, ctx.iteration, self.name))
        history, weights = [], []
        for _ in range(self.params.epochs):
            for index in minibatch_indices(rows, self.params.minibatches, gen,
                                           self.params.shuffle):
                counts = None
                if gang is not None:
                    mask = self.loss_mask(_rows(batch, index))
                    counts = {"tokens": ops.loss_count(mask),
                              "agg": ops.loss_count(mask, self._agg(),
                                                    self.algorithm.loss_scale_factor)}
                    whole, index = index, _rank_rows(batch, index, gang)
                # a minibatch smaller than the gang leaves some ranks nothing; they still
                # join the gradient all-reduce, with a zero loss on one row (weight 0)
                empty = len(index) == 0
                shard = _rows(batch, whole[:1] if empty else index)
                with resident.training():
                    loss, metrics = self.loss(resident, shard, ctx, counts)
                    metrics["grad_norm"] = resident.step(loss * 0.0 if empty else loss, gang)
                local = 0.0 if empty else float(self.loss_mask(shard).sum())
                if counts is not None:
                    # a loss term here is this rank's share of the minibatch's; as a local
                    # mean it averages back (token-weighted) to the minibatch's value
                    for key in _LOSS_TERMS & metrics.keys():
                        metrics[key] *= counts["tokens"] / max(local, 1.0)
                history.append(metrics)
                weights.append(local)
        stats = _mean_metrics(history, weights, gang)
        if len(batch.get("policy_version", ())):  # how many updates behind the rollout was
            staleness = (resident.version - batch["policy_version"]).float()
            stats.update(staleness_mean=float(staleness.mean()),
                         staleness_max=int(staleness.max()))
        # the learning rate the last step used, and the non-finite steps skipped so far
        # (optimizer.skip_nonfinite): reported by the model's optimizer (resident.py)
        stats["lr"] = resident.last_lr
        if resident.skipped_steps:
            stats["nonfinite_steps"] = resident.skipped_steps
        if resident.overflow_steps:  # fp16: steps the loss scaler skipped so far
            stats["overflow_steps"] = resident.overflow_steps
        resident.version += 1
        return {**stats, "version": resident.version}

    def _agg(self) -> str:
        """How this stage's loss aggregates tokens (``ops.LOSS_AGGS``)."""
        return "token-mean"

    def loss_mask(self, batch: Batch) -> torch.Tensor:
        """What the loss counts in a minibatch (its tokens, or one entry per pair): the
        weights of the steps' metrics and, in a gang, the minibatch's divisor."""
        return _loss_mask(batch)

    def _divisor(self, counts: dict[str, float] | None) -> float | None:
        """The ``count`` to pass to the loss: the whole minibatch's divisor when this is a
        shard of it; else None (the batch's own), except that Dr. GRPO's constant
        normaliser comes from the config when it sets one."""
        if counts:
            return counts["agg"]
        if self._agg() == "seq-mean-token-sum-norm":
            return self.algorithm.loss_scale_factor
        return None

    def loss(self, resident, batch: Batch, ctx: StageContext,
             counts: dict[str, float] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one minibatch (or of this rank's shard of it: ``counts`` then holds
        the whole minibatch's ``tokens`` and ``agg`` divisors) and its metrics."""
        raise NotImplementedError


def _loss_mask(batch: Batch) -> torch.Tensor:
    """Response tokens that count in a loss: not those of samples whose score was
    skipped (``score_valid`` 0)."""
    return batch["response_mask"].float() * score_valid(batch).float()[:, None]


def _kl_in_loss(algorithm) -> bool:
    return algorithm.kl_coef > 0 and algorithm.kl_in == "loss"


@register_stage
class TrainActorStage(_Trainer):
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

    def loss(self, resident, batch, ctx, counts=None):
        algo = self.algorithm
        agg, divisor = algo.loss_agg, self._divisor(counts)
        mask = _loss_mask(batch)
        temperature = ctx.settings.temperature
        if algo.entropy_coef > 0:  # the entropy needs the logits themselves
            logits = response_logits(resident.module, batch, temperature)
            logprobs = ops.logprobs_from_logits(logits, batch["response_ids"]) \
                * batch["response_mask"]
        else:  # the same log-probs (0 on padding), without the whole batch's logits
            logprobs = response_logprobs(resident.module, batch, temperature)
        policy_loss = ops.resolve_policy_loss(algo.policy_loss)
        loss, stats = ops.call(policy_loss, {
            "logprobs": logprobs, "old_logprobs": batch[behaviour_column(self.params, batch)],
            "advantages": batch["advantages"], "mask": mask, "agg": agg, "count": divisor,
            "config": algo})
        metrics = {"policy_loss": loss.item(), **stats}
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
class DistillDraftStage(_Trainer):
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
class TrainCriticStage(_Trainer):
    """Critic update: clipped value loss against the GAE returns."""

    type_name = "train_critic"
    model_head = "value"

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return (*RESPONSE_INPUTS, "score_valid", "values", "returns")

    def _agg(self) -> str:
        return self.algorithm.value_loss_agg

    def loss(self, resident, batch, ctx, counts=None):
        mask = _loss_mask(batch)
        values = response_values(resident.module, batch)
        loss, stats = ops.value_loss(values, batch["values"], batch["returns"], mask,
                                     self.algorithm.value_clip, self._divisor(counts),
                                     self.algorithm.value_loss_agg)
        return loss, {"value_loss": loss.item(), "value_clip_frac": stats["value_clip_frac"]}


class OnceParams(StageParams):
    """Training once before the loop: the JSONL file (relative to the pipeline file),
    passes over it, rows per optimizer step, and truncation lengths."""

    data: str | None = Field(None, description="JSONL training file, relative to the "
                                               "pipeline file")
    epochs: Annotated[int, Field(gt=0, description="passes over the data")] = 1
    batch_size: Annotated[int, Field(gt=0, description="rows per optimizer step")] = 16
    max_prompt_tokens: Annotated[int, Field(gt=0, description="prompts are truncated to "
                                                              "this many tokens")] = 64
    max_response_tokens: Annotated[int, Field(gt=0, description="responses are truncated "
                                                                "to this many tokens")] = 64
    shuffle: bool = Field(True, description="shuffle the rows before each pass")


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


def _resolve(path: str, base_dir: Path) -> Path:
    return Path(path) if Path(path).is_absolute() else base_dir / path


def _take(examples: Batch | list, index: torch.Tensor) -> Batch | list:
    if isinstance(examples, dict):
        return _rows(examples, index)
    return [examples[i] for i in index.tolist()]


class _OnceTrainer(Stage):
    """A stage that trains its model once, before the loop, on a data set."""

    Params = OnceParams
    trains = True
    once = True
    per_batch = True
    fields: tuple[str, ...] = ()

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        if params.data is None:
            return ("params.data", "required key is missing")
        path = _resolve(params.data, base_dir)
        if not path.is_file():
            return ("params.data", f"file not found: {path}")
        return None

    def examples(self, resident, base_dir: Path, ctx: StageContext) -> Batch | list:
        """The training set: JSONL records (or a batch of tensors)."""
        return read_jsonl(_resolve(self.params.data, base_dir), self.fields)

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        examples = self.examples(resident, Path(ctx.settings.base_dir), ctx)
        count = len(next(iter(examples.values()))) if isinstance(examples, dict) \
            else len(examples)
        gen = torch.Generator().manual_seed(stage_seed(ctx.seed, self.name))
        history = []
        steps = max(1, -(-count // self.params.batch_size))
        for _ in range(self.params.epochs):
            for index in minibatch_indices(count, steps, gen, self.params.shuffle):
                chunk = _take(examples, index)
                if isinstance(chunk, dict):
                    chunk = {k: v.to(resident.device) for k, v in chunk.items()}
                loss, metrics = self.loss(resident, chunk)
                metrics["grad_norm"] = resident.step(loss)
                history.append(metrics)
        resident.version += 1
        return {**_mean_metrics(history), "version": resident.version, "records": count}


@register_stage
class SFTStage(_OnceTrainer):
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
            path = _resolve(params.buffer, base_dir)
            if not path.is_dir():
                return ("params.buffer", f"experience buffer not found: {path}")
            return None
        return super().check_params(params, has_model, base_dir)

    def examples(self, resident, base_dir: Path, ctx: StageContext) -> Batch | list:
        if self.params.buffer is None:
            return super().examples(resident, base_dir, ctx)
        return buffer_examples(_resolve(self.params.buffer, base_dir), self.params.min_score,
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
class TrainSFTStage(_Trainer):
    """Supervised fine-tuning of the actor on the iteration's responses, every
    iteration: with a ``select`` stage before it, rejection-sampling / best-of-N fine-tuning
    (the ``sft`` stage's loss, on sampled instead of given responses)."""

    type_name = "train_sft"
    Params = TrainSFTParams
    model_head = "lm"

    @classmethod
    def row_filter(cls, params):
        return "selected" if params.selected else None

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
        stats = super().run(_rows({k: v for k, v in batch.items() if k != "selected"}, rows),
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
class RewardModelStage(_OnceTrainer):
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

