"""A user's algorithm module, named by import path in tests (``tests.algorithms_plugin:...``):
an estimator, a registered estimator with needs, and a policy loss."""

from __future__ import annotations

import torch

from rlhfflow import ops


def best_of_group(scores, group_ids, mask):
    """+1 for the best sample of each group, 0 for the rest (ties: all of them)."""
    best = torch.full((int(group_ids.max()) + 1,), float("-inf")).scatter_reduce(
        0, group_ids, scores, "amax")
    return (scores == best[group_ids]).float()[:, None] * mask, None


@ops.register_advantage_estimator("plugin_value_baseline", needs=("values",))
def value_baseline(scores, values, mask):
    """Score minus the critic's value at the first token; returns are the score."""
    advantages = (scores - values[:, 0])[:, None] * mask
    return advantages, scores[:, None] * mask


def reinforce_loss(logprobs, advantages, mask, agg, count):
    """Plain REINFORCE: -A * log pi, aggregated like the configured mode."""
    loss = ops.aggregate_loss(-advantages.detach() * logprobs, mask, agg, count)
    return loss, {"logprob_mean": ops.masked_mean(logprobs.detach(), mask).item()}


def needs_prompts(scores, prompts):
    """Takes an input the advantages stage does not provide."""
    return scores


def per_sample(scores):
    """A mistake: one advantage per sample, not per token."""
    return scores, None
