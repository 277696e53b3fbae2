"""Pure, vectorised torch ops for RLHF: log-probs, KL estimators, masked statistics,
advantage estimators (GAE, GRPO, RLOO, Dr. GRPO, REINFORCE++, ReMax), PPO/GSPO policy
and value losses with veRL's loss aggregations, entropy, the DPO loss and the pairing
and best-of-N selection of responses by score (:mod:`rlhfflow.ops.preference`); per-turn
credit for multi-turn episodes (:mod:`rlhfflow.ops.turns`); off-policy correction
(:mod:`rlhfflow.ops.offpolicy`); and the
registries through which configs pick an estimator and a policy loss. The registries
import no torch, so a config is checked without it; the torch ops load on first use.

Use as ``from rlhfflow import ops; adv, ret = ops.gae(rewards, values, mask, 1.0, 0.95)``.
Every function is free of I/O and of imports from the rest of rlhfflow; shapes are
documented in each docstring (see :mod:`rlhfflow.ops.core`, :mod:`rlhfflow.ops.advantages`,
:mod:`rlhfflow.ops.losses`, :mod:`rlhfflow.ops.registry`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlhfflow.ops.registry import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_INPUTS,
    ESTIMATOR_NEEDS,
    POLICY_LOSS_INPUTS,
    POLICY_LOSSES,
    call,
    estimator_grouped,
    estimator_needs,
    get_advantage_estimator,
    get_policy_loss,
    load_callable,
    register_advantage_estimator,
    register_policy_loss,
    resolve_advantage_estimator,
    resolve_policy_loss,
    signature_problem,
    takes,
)

if TYPE_CHECKING:  # imported on first use (``__getattr__``)
    from rlhfflow.ops.advantages import (
        GROUP_MODES,
        SCALE_REWARDS,
        gae,
        group_advantages,
        reinforce_plus_plus,
        reinforce_plus_plus_baseline,
        remax,
    )
    from rlhfflow.ops.core import (
        KL_KINDS,
        kl,
        logprobs_from_logits,
        masked_mean,
        masked_var,
        masked_whiten,
        tempered,
        token_rewards,
    )
    from rlhfflow.ops.losses import (
        IS_LEVELS,
        LOSS_AGGS,
        aggregate_loss,
        entropy,
        entropy_from_logits,
        loss_count,
        policy_loss,
        value_loss,
    )
    from rlhfflow.ops.offpolicy import CORRECTIONS, OFF_POLICY_LEVELS, off_policy_weights
    from rlhfflow.ops.preference import best_in_group, dpo_loss, preference_pairs
    from rlhfflow.ops.turns import (
        call_per_turn,
        per_turn_rewards,
        per_turn_token_rewards,
        turn_index,
        turn_returns,
    )

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTIONS",
    "ESTIMATOR_INPUTS",
    "ESTIMATOR_NEEDS",
    "GROUP_MODES",
    "IS_LEVELS",
    "KL_KINDS",
    "LOSS_AGGS",
    "OFF_POLICY_LEVELS",
    "POLICY_LOSSES",
    "POLICY_LOSS_INPUTS",
    "SCALE_REWARDS",
    "aggregate_loss",
    "best_in_group",
    "call",
    "call_per_turn",
    "dpo_loss",
    "entropy",
    "entropy_from_logits",
    "estimator_grouped",
    "estimator_needs",
    "gae",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_advantages",
    "kl",
    "load_callable",
    "logprobs_from_logits",
    "loss_count",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "off_policy_weights",
    "per_turn_rewards",
    "per_turn_token_rewards",
    "policy_loss",
    "preference_pairs",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "resolve_advantage_estimator",
    "resolve_policy_loss",
    "signature_problem",
    "takes",
    "tempered",
    "token_rewards",
    "turn_index",
    "turn_returns",
    "value_loss",
]


# The torch modules, in the order their names are looked up.
_TORCH_MODULES = ("core", "advantages", "losses", "offpolicy", "preference", "turns")


def __getattr__(name: str) -> Any:
    """The torch ops, imported on first use: the registries above are what a config is
    checked against, and checking one (``rlhfflow plan``, ``validate``) needs no torch."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for module_name in _TORCH_MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        if name in vars(module):
            value = vars(module)[name]
            globals()[name] = value  # found once; later uses do not come back here
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """Every name, the torch ops not imported yet included (for ``dir`` and completion)."""
    return sorted(set(globals()) | set(__all__))
