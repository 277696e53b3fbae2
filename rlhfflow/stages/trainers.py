"""What the built-in training stages share: ``Trainer`` (epochs of shuffled minibatches,
one optimizer step each, data-parallel over a gang) for the stages that train in the loop,
and ``OnceTrainer`` for those that train once before it on a data set, with their params.
``train_actor``, ``train_critic``, ``train_sft`` and ``train_dpo_online`` build on the
first; ``sft``, ``reward_model`` and ``train_dpo`` on the second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field

from rlhfflow import ops
from rlhfflow.data.records import read_jsonl
from rlhfflow.engine.batch import score_valid
from rlhfflow.engine.forward import minibatch_indices, shared_prompt_rows, stage_seed
from rlhfflow.engine.parallel import allreduce_sum
from rlhfflow.sdk import Batch, Stage, StageContext, StageParams


class TrainParams(StageParams):
    """Passes over the batch and optimizer steps per pass."""

    epochs: Annotated[int, Field(gt=0, description="passes over the iteration's batch")] = 1
    minibatches: Annotated[int, Field(gt=0, description="optimizer steps per pass (the "
                                                        "batch split evenly)")] = 1
    shuffle: bool = Field(True, description="shuffle the rows before each pass")


def take_rows(batch: Batch, index: torch.Tensor) -> Batch:
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


def mean_metrics(history: list[dict[str, float]], weights: list[float] | None = None,
                  gang=None) -> dict[str, float]:
    """Mean of each metric over the steps, weighted by ``weights`` and taken over the
    whole gang (every rank gets the same numbers)."""
    keys = list(history[0]) if history else []
    weights = weights or [1.0] * len(history)
    sums = [sum(w * h[k] for h, w in zip(history, weights, strict=True)) for k in keys]
    totals = allreduce_sum([*sums, float(sum(weights))], gang)
    return {k: v / max(totals[-1], 1e-12) for k, v in zip(keys, totals, strict=False)}


_LOSS_TERMS = {"policy_loss", "kl_loss", "entropy", "value_loss"}


def loss_mask_of(batch: Batch) -> torch.Tensor:
    """Response tokens that count in a loss: not those of samples whose score was
    skipped (``score_valid`` 0)."""
    return batch["response_mask"].float() * score_valid(batch).float()[:, None]


class Trainer(Stage):
    """Shared loop: epochs x shuffled minibatches, one optimizer step per minibatch.

    In a data-parallel gang (``ctx.gang``) every rank sees the whole batch, draws the same
    minibatches and trains on its shard of each; losses are divided by the minibatch's
    own counts (``ops.loss_count``), so the summed gradients equal one worker's update
    on the whole minibatch. ``backend`` is ``"torch"``, ``"deepspeed"`` or ``"fsdp"`` (the
    model sharded over the gang; the stage's ``backend:``/``deepspeed:`` keys, given by
    ``Stage.use_backend``).
    """

    Params = TrainParams
    trains = True
    per_batch = True

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        gang = ctx.gang
        if self.backend == "deepspeed" and resident.engine is None:
            options = self.deepspeed or {}
            resident.use_deepspeed(options.get("zero_stage", 2), options.get("config", {}),
                                   gang.rank if gang else 0)
        if self.backend == "fsdp" and not resident.sharded:
            resident.use_fsdp(gang)
        batch = {k: v.to(resident.device) for k, v in batch.items()
                 if isinstance(v, torch.Tensor)}
        batch = self.before_steps(resident, batch, ctx)
        rows = len(next(iter(batch.values()))) if batch else 0
        gen = torch.Generator().manual_seed(stage_seed(ctx.seed, ctx.iteration, self.name))
        history, weights = [], []
        for _ in range(self.params.epochs):
            for index in minibatch_indices(rows, self.params.minibatches, gen,
                                           self.params.shuffle):
                counts = None
                if gang is not None:
                    mask = self.loss_mask(take_rows(batch, index))
                    counts = {"tokens": ops.loss_count(mask),
                              "agg": ops.loss_count(mask, self._agg(),
                                                    self.algorithm.loss_scale_factor)}
                    whole, index = index, _rank_rows(batch, index, gang)
                # a minibatch smaller than the gang leaves some ranks nothing; they still
                # join the gradient all-reduce, with a zero loss on one row (weight 0)
                empty = len(index) == 0
                shard = take_rows(batch, whole[:1] if empty else index)
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
        stats = mean_metrics(history, weights, gang)
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

    def before_steps(self, resident, batch: Batch, ctx: StageContext) -> Batch:
        """Columns the loss needs that the model computes once, before the iteration's
        first step (the batch on the model's device); the batch as it is by default."""
        return batch

    def _agg(self) -> str:
        """How this stage's loss aggregates tokens (``ops.LOSS_AGGS``)."""
        return "token-mean"

    def loss_mask(self, batch: Batch) -> torch.Tensor:
        """What the loss counts in a minibatch (its tokens, or one entry per pair): the
        weights of the steps' metrics and, in a gang, the minibatch's divisor."""
        return loss_mask_of(batch)

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


def resolve_path(path: str, base_dir: Path) -> Path:
    return Path(path) if Path(path).is_absolute() else base_dir / path


def _take(examples: Batch | list, index: torch.Tensor) -> Batch | list:
    if isinstance(examples, dict):
        return take_rows(examples, index)
    return [examples[i] for i in index.tolist()]


class OnceTrainer(Stage):
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
        path = resolve_path(params.data, base_dir)
        if not path.is_file():
            return ("params.data", f"file not found: {path}")
        return None

    def examples(self, resident, base_dir: Path, ctx: StageContext) -> Batch | list:
        """The training set: JSONL records (or a batch of tensors)."""
        return read_jsonl(resolve_path(self.params.data, base_dir), self.fields)

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
        return {**mean_metrics(history), "version": resident.version, "records": count}
