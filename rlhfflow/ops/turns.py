"""Per-turn credit for multi-turn episodes: which model turn each response token belongs
to, the rewards of each turn and their discounted returns, and an outcome estimator
(GRPO, RLOO, ...) applied to turns instead of whole episodes.

A model turn is a run of consecutive tokens where ``mask`` is 1 (the environment's tokens
between two turns are 0). The rewards of a turn sit on its last token in
``turn_rewards`` (the ``rollout`` stage writes them there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from rlhfflow.ops.core import token_rewards


def turn_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's model turn.

    Args:
        mask: `(torch.Tensor)` shape: (bs, response_length), 1 on the model's tokens

    Returns:
        index: `(torch.Tensor)` int64, shape: (bs, response_length): 0 for the tokens of
            the first turn (and any before it), 1 for the second, ...; 0 where mask is 0
        turns: `(torch.Tensor)` int64, shape: (bs,): the model turns of each row
    """
    valid = mask.bool()
    starts = valid & ~F.pad(valid[:, :-1], (1, 0), value=False)
    index = (starts.long().cumsum(-1) - 1).clamp(min=0) * valid
    return index, starts.long().sum(-1)


def per_turn_rewards(turn_rewards: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                     kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Each turn's reward: the environment's reward of the turn, the part of the
    episode's score the turns' rewards do not account for on the last turn (so the turns
    sum to the score), and minus ``kl_coef`` times the KL of the turn's tokens.

    Args:
        turn_rewards: `(torch.Tensor)` shape: (bs, response_length), a turn's reward on
            its last token
        scores: `(torch.Tensor)` shape: (bs,), the episode's score
        mask: `(torch.Tensor)` shape: (bs, response_length)
        kl: `(torch.Tensor)` shape: (bs, response_length) or None
        kl_coef: weight of the KL penalty

    Returns:
        rewards: `(torch.Tensor)` shape: (bs, turns), 0 past a row's last turn
    """
    index, turns = turn_index(mask)
    width = max(int(turns.max()) if turns.numel() else 0, 1)
    weight = mask.float()
    rewards = torch.zeros(len(mask), width).scatter_add_(1, index,
                                                         turn_rewards.float() * weight)
    last = (turns - 1).clamp(min=0)[:, None]
    rest = (scores.float() - rewards.sum(-1)) * (turns > 0)
    rewards.scatter_add_(1, last, rest[:, None])
    if kl is not None and kl_coef:
        rewards -= kl_coef * torch.zeros_like(rewards).scatter_add_(1, index,
                                                                    kl.float() * weight)
    return rewards


def turn_returns(rewards: torch.Tensor, turns: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted returns per turn, ``G[k] = r[k] + gamma * G[k + 1]``.

    Args:
        rewards: `(torch.Tensor)` shape: (bs, turns), as ``per_turn_rewards``
        turns: `(torch.Tensor)` int64, shape: (bs,), the model turns of each row
        gamma: discount per model turn

    Returns:
        returns: `(torch.Tensor)` shape: (bs, turns), 0 past a row's last turn
    """
    returns = torch.zeros_like(rewards)
    ahead = torch.zeros(len(rewards), dtype=rewards.dtype)
    for k in reversed(range(rewards.shape[1])):  # few turns; vectorised over rows
        ahead = rewards[:, k] + gamma * ahead
        returns[:, k] = ahead
    return returns * (torch.arange(rewards.shape[1])[None, :] < turns[:, None])


def per_turn_token_rewards(turn_rewards: torch.Tensor, scores: torch.Tensor,
                           mask: torch.Tensor, kl: torch.Tensor | None = None,
                           kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards for the token-level estimators (GAE, REINFORCE++, ReMax): each
    turn's reward on its last token, ``per_turn_rewards``'s remainder of the score on
    the last model token, and the KL penalty on every model token.

    Returns:
        rewards: `(torch.Tensor)` shape: (bs, response_length), 0 where mask is 0
    """
    weight = mask.float()
    own = turn_rewards.float() * weight
    kl_term = kl.float() if kl is not None else torch.zeros_like(weight)
    return own + token_rewards(scores.float() - own.sum(-1), kl_term, weight,
                               kl_coef if kl is not None else 0.0)


def call_per_turn(estimator: Callable[..., Any], inputs: Mapping[str, Any],
                  call: Callable[[Callable[..., Any], Mapping[str, Any]], Any],
                  returns: torch.Tensor) -> torch.Tensor:
    """An outcome estimator (one score per sample: GRPO, RLOO, Dr. GRPO, REINFORCE++
    with a group baseline) with each model turn as a sample: its score the turn's
    discounted return, its mask the turn's tokens, its group the episode's group and the
    turn's position (turn ``k`` of an episode is compared with turn ``k`` of the other
    episodes of its prompt). Each token gets its turn's advantage.

    Args:
        inputs: the estimator inputs of whole episodes (``mask`` (bs, response_length),
            ``group_ids`` (bs,), ``config``, ...)
        call: ``ops.call``
        returns: `(torch.Tensor)` shape: (bs, turns), ``turn_returns``

    Returns:
        advantages: `(torch.Tensor)` shape: (bs, response_length)
    """
    mask = inputs["mask"]
    index, turns = turn_index(mask)
    rows, turn = torch.nonzero(torch.arange(returns.shape[1])[None, :] < turns[:, None],
                               as_tuple=True)
    flat = dict(inputs)
    flat["mask"] = mask[rows] * (index[rows] == turn[:, None])
    flat["scores"] = returns[rows, turn]
    if "group_ids" in inputs:
        pairs = torch.stack([inputs["group_ids"][rows].long(), turn], dim=-1)
        flat["group_ids"] = torch.unique(pairs, dim=0, return_inverse=True)[1]
    for name in ("token_rewards", "values", "baseline_scores"):
        if isinstance(inputs.get(name), torch.Tensor):
            flat[name] = inputs[name][rows]
    advantages, _ = call(estimator, flat)
    out = torch.zeros(mask.shape, dtype=advantages.dtype)
    return out.index_add_(0, rows, advantages * flat["mask"])
