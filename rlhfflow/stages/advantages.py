"""``advantages``: turn scores (and values, KL) into per-token advantages.

PPO: per-token KL penalty plus the score at the last token, GAE, whitened advantages.
GRPO / RLOO / Dr. GRPO: group-relative advantages over the samples of each prompt,
broadcast to every response token; the KL term goes in the reward or in the loss
(``algorithm.kl_in``). The stage needs the whole batch (whitening and groups span it).
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
        cols = ["scores", "score_valid", "response_mask"]
        cols += ["values"] if algorithm.uses_critic else ["group_ids"]
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
        if algo.uses_critic:
            kl_term = kl if kl is not None else torch.zeros_like(mask)
            rewards = ops.token_rewards(scores, kl_term, mask, algo.kl_coef if kl is not None
                                        else 0.0)
            advantages, returns = ops.gae(rewards, batch["values"].float(), mask,
                                          algo.gamma, algo.lam)
            out["returns"] = returns
        else:
            if kl is not None:  # sequence-level KL penalty folded into the score
                scores = scores - algo.kl_coef * (kl * mask).sum(-1)
            # group statistics over the samples that have a score
            seq_adv = torch.zeros_like(scores)
            seq_adv[valid] = ops.group_advantages(scores[valid], batch["group_ids"][valid],
                                                  algo.name)
            advantages = seq_adv[:, None] * mask
        if algo.whiten_advantages and algo.uses_critic:
            advantages = ops.masked_whiten(advantages, mask)
        out["advantages"] = advantages * mask
        return out
