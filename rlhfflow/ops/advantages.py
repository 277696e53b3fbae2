"""Advantage estimators: GAE, the group-relative family (GRPO, RLOO, Dr. GRPO),
REINFORCE++ (with and without a group baseline) and ReMax; pure, vectorised and
gradient-free. The shape legend is :mod:`rlhfflow.ops.core`'s.
"""

from __future__ import annotations

import torch

from rlhfflow.ops.core import float_dtype, masked_var, masked_whiten

GROUP_MODES = ("grpo", "rloo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al., 2016), not whitened.

    The value after the last token is 0. Positions where ``mask`` is 0 are skipped: the
    next valid value and the running advantage carry over them unchanged (as veRL's
    ``compute_gae_advantage_return`` with a response mask), so interior padding behaves
    as if those tokens were removed. Outputs are detached: they are regression targets.

    Args:
        rewards: `(torch.Tensor)` shape: (bs, response_length)
        values: `(torch.Tensor)` shape: (bs, response_length)
        mask: `(torch.Tensor)` shape: (bs, response_length), 1 on valid tokens
        gamma: discount factor
        lam: GAE lambda (bias/variance trade-off)

    Returns:
        advantages: `(torch.Tensor)` shape: (bs, response_length), 0 where mask is 0
        returns: `(torch.Tensor)` shape: (bs, response_length), advantages + values, 0 where
            mask is 0
    """
    dtype = float_dtype(rewards, values)
    rewards, values = rewards.to(dtype), values.to(dtype)
    valid = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    next_values = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    last_gae = torch.zeros_like(next_values)
    advs_reversed = []
    # The recursion is inherently sequential in t; it is vectorised over the batch.
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        candidate = delta + gamma * lam * last_gae
        # where() instead of m*x + (1-m)*y: padded values may be garbage (inf/NaN).
        next_values = torch.where(valid[:, t], values[:, t], next_values)
        last_gae = torch.where(valid[:, t], candidate, last_gae)
        advs_reversed.append(torch.where(valid[:, t], last_gae, zero))
    if advs_reversed:
        advantages = torch.stack(advs_reversed[::-1], dim=1)
    else:
        advantages = torch.zeros_like(rewards)
    returns = torch.where(valid, advantages + values, zero)
    return advantages, returns


@torch.no_grad()
def group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, mode: str = "grpo", eps: float = 1e-6,
    scale: str = "group",
) -> torch.Tensor:
    """Outcome-level advantages relative to the other samples of the same prompt group.

    Modes:
        "grpo":    (score - group mean) / (std + eps), the std chosen by ``scale``
        "rloo":    score - mean of the *other* scores in the group (leave-one-out baseline)
        "dr_grpo": score - group mean (Dr. GRPO: no std division, avoids difficulty bias);
                   the same as ``"grpo"`` with ``scale="none"``
    A group with a single sample has no baseline and gets advantage 0 in every mode.

    Args:
        scores: `(torch.Tensor)` shape: (N,), one scalar reward per sample
        group_ids: `(torch.Tensor)` int64, shape: (N,), arbitrary ids (need not be sorted
            or contiguous); samples with the same id form a group
        mode: one of ``"grpo"``, ``"rloo"``, ``"dr_grpo"``
        eps: added to the std in ``"grpo"`` so constant-score groups give 0, not NaN
        scale: ``"grpo"`` only (TRL's ``scale_rewards``): ``"group"`` divides by the
            unbiased std of the sample's group, ``"batch"`` by the unbiased std of all
            ``scores``, ``"none"`` by nothing

    Returns:
        advantages: `(torch.Tensor)` shape: (N,), detached
    """
    if mode not in GROUP_MODES:
        raise ValueError(f"unknown group advantage mode {mode!r}; expected one of {GROUP_MODES}")
    if scale not in SCALE_REWARDS:
        raise ValueError(f"unknown scale {scale!r}; expected one of {SCALE_REWARDS}")
    if scores.shape != group_ids.shape or scores.dim() != 1:
        raise ValueError(
            f"scores and group_ids must both be 1-D of equal length, got "
            f"{tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    x = scores.to(float_dtype(scores))
    # Dense 0..G-1 indices let bincount/index_add_ replace a per-group Python loop.
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    num_groups = uniq.numel()
    counts = torch.bincount(inv, minlength=num_groups).to(x.dtype)
    sums = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, x)
    n = counts[inv]
    has_peers = n > 1
    zero = torch.zeros((), dtype=x.dtype, device=x.device)

    if mode == "rloo":
        baseline = (sums[inv] - x) / (n - 1).clamp_min(1.0)
        return torch.where(has_peers, x - baseline, zero)

    centered = x - (sums / counts)[inv]
    if mode == "dr_grpo" or scale == "none":
        return torch.where(has_peers, centered, zero)
    if scale == "batch":
        # TRL's "batch": centred per group, scaled by the std of the whole batch's scores
        std = masked_var(x, torch.ones_like(x)).sqrt()
        return torch.where(has_peers, centered / (std + eps), zero)

    # Two-pass (sum of squared deviations) rather than E[x^2]-E[x]^2: no cancellation.
    sq = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(
        0, inv, centered.square()
    )
    std = (sq / (counts - 1).clamp_min(1.0)).sqrt()
    return torch.where(has_peers, centered / (std[inv] + eps), zero)


@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): discounted reward-to-go, whitened over the batch's tokens.

    ``returns[b, t] = sum_{k >= t} gamma^(k-t) * token_rewards[b, k]`` over valid tokens
    (masked positions are skipped, as in ``gae``); ``advantages = masked_whiten(returns)``.
    The KL penalty belongs in ``token_rewards`` (``token_rewards(..., kl_coef)``).

    Args:
        token_rewards: `(torch.Tensor)` shape: (bs, response_length)
        mask: `(torch.Tensor)` shape: (bs, response_length)
        gamma: discount factor

    Returns:
        advantages: `(torch.Tensor)` shape: (bs, response_length), 0 where mask is 0
        returns: `(torch.Tensor)` shape: (bs, response_length), 0 where mask is 0
    """
    # GAE with zero values and lambda 1 is exactly the discounted reward-to-go.
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def reinforce_plus_plus_baseline(
    scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++ with baseline: score minus its group's mean, broadcast to the tokens
    and whitened over the batch's valid tokens (veRL's ``reinforce_plus_plus_baseline``).

    Args:
        scores: `(torch.Tensor)` shape: (bs,), one scalar reward per sample
        group_ids: `(torch.Tensor)` int64, shape: (bs,)
        mask: `(torch.Tensor)` shape: (bs, response_length)

    Returns:
        advantages: `(torch.Tensor)` shape: (bs, response_length), 0 where mask is 0.
        A group of one has no baseline: its centred score is 0 before whitening.
    """
    centered = group_advantages(scores, group_ids, "dr_grpo")
    return masked_whiten(centered[:, None] * mask, mask)


@torch.no_grad()
def remax(
    token_rewards: torch.Tensor, baseline_scores: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., 2023): reward-to-go minus the score of the greedy response.

    Args:
        token_rewards: `(torch.Tensor)` shape: (bs, response_length), the sampled
            response's rewards (score at its last token, KL penalties if any)
        baseline_scores: `(torch.Tensor)` shape: (bs,), score of the greedy response to
            the same prompt
        mask: `(torch.Tensor)` shape: (bs, response_length)

    Returns:
        advantages: `(torch.Tensor)` shape: (bs, response_length), 0 where mask is 0
        returns: `(torch.Tensor)` shape: (bs, response_length), undiscounted
            reward-to-go, 0 where mask is 0
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    rewards = torch.where(valid, token_rewards, zero)
    returns = torch.where(valid, rewards.flip(-1).cumsum(-1).flip(-1), zero)
    advantages = torch.where(valid, returns - baseline_scores.to(returns.dtype)[:, None], zero)
    return advantages, returns
