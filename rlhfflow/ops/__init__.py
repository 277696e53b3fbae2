"""Pure, vectorised torch ops for RLHF: log-probs, KL estimators, masked statistics,
advantage estimators (GAE, GRPO, RLOO, Dr. GRPO), PPO policy/value losses and entropy.

Use as ``from rlhfflow import ops; adv, ret = ops.gae(rewards, values, mask, 1.0, 0.95)``.
Every function is free of I/O and of imports from the rest of rlhfflow; shapes are
documented in each docstring (see :mod:`rlhfflow.ops.core`).
"""

from rlhfflow.ops.core import (
    ADVANTAGE_ESTIMATORS,
    entropy,
    entropy_from_logits,
    gae,
    get_advantage_estimator,
    group_advantages,
    kl,
    logprobs_from_logits,
    loss_count,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    register_advantage_estimator,
    token_rewards,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "entropy",
    "entropy_from_logits",
    "gae",
    "get_advantage_estimator",
    "group_advantages",
    "kl",
    "logprobs_from_logits",
    "loss_count",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "register_advantage_estimator",
    "token_rewards",
    "value_loss",
]
