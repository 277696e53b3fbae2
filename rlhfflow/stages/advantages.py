"""``advantages``: turn scores (and values, KL) into per-token advantages.

The estimator is the one ``algorithm`` names (``AlgorithmSpec.estimator``), looked up in
the ops registry (``ops.resolve_advantage_estimator``) and called with the standard inputs
its signature names (``ops.registry``): PPO's GAE over per-token rewards (KL penalty plus
the score at the last token), group-relative GRPO / RLOO / Dr. GRPO, REINFORCE++ (with
or without a group baseline), ReMax, or a user's function by import path. The KL term goes
in the reward or in the loss (``algorithm.kl_in``). The stage needs the whole batch
(whitening and groups span it).
"""

from __future__ import annotations

import torch

from rlhfflow import ops
from rlhfflow.stages.base import Batch, Column, Stage, StageContext, StageParams, register_stage


def score_valid(batch: Batch) -> torch.Tensor:
    """``[N]`` bool: samples with a usable score. A batch built by hand, without the
    ``score_valid`` column the score stage writes, has all samples valid."""
    if "score_valid" in batch:
        return batch["score_valid"].bool()
    return torch.ones(len(batch["response_mask"]), dtype=torch.bool)


def _kl_in_reward(algorithm) -> bool:
    return algorithm.kl_coef > 0 and algorithm.kl_in == "reward"


@register_stage
class AdvantagesStage(Stage):
    """Advantages and (for PPO) returns, per the pipeline's ``algorithm``."""

    type_name = "advantages"
    Params = StageParams
    per_batch = True

    @classmethod
    def reads(cls, params, algorithm, has_model):
        cols = ["scores", "score_valid", "response_mask", *algorithm.estimator_needs]
        if ops.takes(ops.resolve_advantage_estimator(algorithm.estimator), "group_ids"):
            cols.append("group_ids")
        if _kl_in_reward(algorithm):
            cols += ["old_logprobs", "ref_logprobs"]
        return tuple(cols)

    @classmethod
    def writes(cls, params, algorithm, has_model):
        out = {"advantages": Column("float32", "response")}
        if algorithm.uses_critic:
            out["returns"] = Column("float32", "response")
        if _kl_in_reward(algorithm):
            out["kl"] = Column("float32", "response")
        return out

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        algo = self.algorithm
        valid = score_valid(batch)
        mask = batch["response_mask"].float() * valid[:, None]  # skipped samples: no tokens
        scores = batch["scores"].float()
        out: Batch = {}
        kl = None
        if _kl_in_reward(algo):
            kl = ops.kl(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_estimator) * mask
            out["kl"] = kl
        kl_term = kl if kl is not None else torch.zeros_like(mask)
        token_rewards = ops.token_rewards(scores, kl_term, mask,
                                          algo.kl_coef if kl is not None else 0.0)
        if kl is not None:  # the same penalty, summed, for the outcome-level estimators
            scores = scores - algo.kl_coef * (kl * mask).sum(-1)
        inputs = {"scores": scores, "token_rewards": token_rewards, "mask": mask,
                  "config": algo}
        if "group_ids" in batch:  # read only when the estimator takes it (see reads)
            inputs["group_ids"] = batch["group_ids"]
        for column in algo.estimator_needs:
            inputs[column] = batch[column].float()
        # estimators see only the samples with a score: group statistics, whitening and
        # baselines never include a skipped sample
        rows = None if bool(valid.all()) else valid
        if rows is not None:
            inputs = {k: (v[rows] if isinstance(v, torch.Tensor) else v)
                      for k, v in inputs.items()}
        estimator = ops.resolve_advantage_estimator(algo.estimator)
        advantages, returns = ops.call(estimator, inputs)
        if rows is not None:
            advantages = _scatter_rows(advantages, rows, mask)
            returns = None if returns is None else _scatter_rows(returns, rows, mask)
        if algo.uses_critic:
            out["returns"] = returns
        out["advantages"] = advantages * mask
        return out


def _scatter_rows(part: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (a bool [N] mask) of a zero tensor shaped ``like`` set to ``part``."""
    full = torch.zeros_like(like, dtype=part.dtype)
    full[rows] = part
    return full
