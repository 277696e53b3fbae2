"""Preference ops: the DPO loss, and the pairing and selection of sampled responses by
score within their prompt's group (online DPO, best-of-N / rejection sampling).

Pure tensor functions; the group statistics are vectorised (``scatter_reduce``, stable
sorts), never a loop over prompts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
             beta: float = 0.1, label_smoothing: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sigmoid DPO loss (Rafailov et al., 2023) per pair, and the implicit rewards.

    Args:
        chosen_logps, rejected_logps: ``[P]`` summed response log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: ``[P]`` the same under the frozen reference.
        beta: the strength of the KL constraint to the reference.
        label_smoothing: the assumed probability that a pair's labels are flipped
            (conservative DPO); 0 is plain DPO.

    Returns:
        ``(losses [P], chosen_rewards [P], rejected_rewards [P])``: the loss is
        ``-(1-e) log sigmoid(beta h) - e log sigmoid(-beta h)`` with ``h`` the difference
        of the chosen and rejected log-ratios; the implicit rewards are
        ``beta * (logp - ref_logp)``, detached. When policy equals reference every loss is
        ``log 2``.
    """
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps)
    logits = chosen_rewards - rejected_rewards
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) \
        - label_smoothing * F.logsigmoid(-logits)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def _groups(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each row's group as ``0..G-1`` and ``G``."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, len(uniq)


def preference_pairs(scores: torch.Tensor, group_ids: torch.Tensor,
                     valid: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One (chosen, rejected) pair per group: its best and its worst scored row.

    Args:
        scores: ``[N]`` one score per response.
        group_ids: ``[N]`` the prompt each response answers (rows of one group compete).
        valid: ``[N]`` bool, rows with a usable score (default: all).

    Returns:
        ``(chosen [P], rejected [P], ties)``: row indices of the pairs, in the order of the
        groups' ids, and how many groups of at least two valid rows had no pair because
        all their scores were equal. The first row of a group wins a tie for best or worst.
    """
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    group, count = _groups(group_ids)
    rows = torch.arange(len(scores))
    scores = scores.float()
    best = torch.full((count,), -torch.inf).scatter_reduce(
        0, group[valid], scores[valid], "amax")
    worst = torch.full((count,), torch.inf).scatter_reduce(
        0, group[valid], scores[valid], "amin")
    size = torch.zeros(count, dtype=torch.long).index_add_(0, group, valid.long())
    none = torch.full((count,), len(scores), dtype=torch.long)
    is_best = valid & (scores == best[group])
    is_worst = valid & (scores == worst[group])
    chosen = none.scatter_reduce(0, group[is_best], rows[is_best], "amin")
    rejected = none.scatter_reduce(0, group[is_worst], rows[is_worst], "amin")
    paired = (size >= 2) & (best > worst)
    ties = int(((size >= 2) & (best == worst)).sum())
    return chosen[paired], rejected[paired], ties


def best_in_group(scores: torch.Tensor, group_ids: torch.Tensor,
                  valid: torch.Tensor | None = None, top_k: int = 1,
                  min_score: float | None = None) -> torch.Tensor:
    """``[N]`` bool: the ``top_k`` best scored rows of each group (best-of-N), optionally
    only those scoring at least ``min_score``.

    Args:
        scores: ``[N]`` one score per response.
        group_ids: ``[N]`` the prompt each response answers.
        valid: ``[N]`` bool, rows with a usable score (default: all); others never win.
        top_k: how many rows each group keeps.
        min_score: a row must score at least this to be kept (None: no threshold).

    Ties are broken by row order (the earlier row ranks higher), so exactly
    ``min(top_k, valid rows)`` rows of a group are kept before the threshold.
    """
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    ranked = torch.where(valid, scores.float(), torch.tensor(-torch.inf))
    group, count = _groups(group_ids)
    # stable sorts: by score (best first), then by group; the row order breaks ties
    order = torch.sort(-ranked, stable=True).indices
    order = order[torch.sort(group[order], stable=True).indices]
    positions = torch.arange(len(scores))
    first = torch.full((count,), len(scores), dtype=torch.long).scatter_reduce(
        0, group[order], positions, "amin")
    rank = torch.empty_like(positions)
    rank[order] = positions - first[group[order]]
    keep = valid & (rank < top_k)
    if min_score is not None:
        keep &= scores >= min_score
    return keep
