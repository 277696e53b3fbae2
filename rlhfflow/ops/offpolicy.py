"""Off-policy correction: weights for the policy loss when the tokens were sampled by a
policy other than the one the update is measured against.

Three policies meet in an update of asynchronous or partial rollouts: the **behaviour**
policy that sampled a token (its log-prob recorded while sampling, ``sample_logprobs``;
an older version of the weights, or another engine's numerics), the **proximal** policy
the PPO ratio is clipped around (the current weights before the step, their log-probs
recomputed by a ``logprob`` stage: ``old_logprobs``), and the policy being trained. The
PPO ratio ``pi_theta / pi_prox`` keeps the step small; the importance weight
``w = pi_prox / pi_b`` (detached) corrects for sampling from ``pi_b``. The corrections
differ in how they bound ``w``:

- ``tis``, truncated importance sampling (Yao et al. 2025, veRL's ``tis_imp_ratio_cap``,
  TRL's ``vllm_importance_sampling_cap``): ``min(w, cap)``;
- ``mis``, masked importance sampling (veRL's rollout correction in ``mask`` mode): a
  token (or sequence) whose ``w`` falls outside ``[low, high]`` leaves the loss, the
  others keep ``w``;
- ``decoupled``, decoupled PPO (AReaL, Fu et al. 2025): ``w`` unbounded below, a token
  whose ``w`` exceeds ``cap`` leaves the loss.

``level`` says what one weight covers: ``token`` (each token its own ratio),
``sequence`` (the product of the row's token ratios, the exact sequence-level weight) or
``geometric`` (their geometric mean, a length-independent sequence weight; with ``mis``
the geometric sequence mask). A token that leaves the loss gets weight 0: it still counts
in the loss's denominator (``aggregate_loss``), so one worker and a data-parallel gang,
whose ranks divide by the whole minibatch's count, compute the same update. When every
token is on-policy (``pi_b == pi_prox``) every weight is 1 and the loss is the
uncorrected one.
"""

from __future__ import annotations

import torch

from rlhfflow.ops.core import kl, masked_mean

CORRECTIONS = ("none", "tis", "mis", "decoupled")
OFF_POLICY_LEVELS = ("token", "sequence", "geometric")

# log-ratios beyond this are clamped before exp (as the PPO ratio's): e^20 is ~5e8
_LOG_CLAMP = 20.0


def off_policy_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    correction: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token importance weights of an off-policy correction.

    Args:
        proximal_logprobs: `(torch.Tensor)` shape: (bs, response_length), the policy the
            PPO ratio is taken against (recomputed before the step)
        behaviour_logprobs: `(torch.Tensor)` shape: (bs, response_length), the policy that
            sampled each token (recorded while sampling)
        mask: `(torch.Tensor)` shape: (bs, response_length), 1 on tokens the loss counts
        correction: ``"tis"``, ``"mis"`` or ``"decoupled"`` (``CORRECTIONS``; ``"none"``
            gives weights of 1 and the mask unchanged)
        level: ``"token"``, ``"sequence"`` or ``"geometric"`` (``OFF_POLICY_LEVELS``)
        cap: ``tis``: the truncation ``min(w, cap)``; ``decoupled``: a token whose weight
            exceeds it leaves the loss
        low, high: ``mis``: the bounds a weight must lie within to stay

    Returns:
        weights: `(torch.Tensor)` shape: (bs, response_length), detached; 0 off the mask
            and on tokens that left the loss
        stats: python floats over the valid tokens of ``mask``: ``is_ratio_mean``,
            ``is_ratio_min``, ``is_ratio_max`` (the unbounded weights), ``is_bounded_frac``
            (the share of tokens whose weight was truncated or which left the loss) and
            ``mismatch_kl`` (k3 estimate of KL(pi_b || pi_prox) per token)
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {correction!r}; expected one of "
                         f"{CORRECTIONS}")
    if level not in OFF_POLICY_LEVELS:
        raise ValueError(f"unknown off-policy level {level!r}; expected one of "
                         f"{OFF_POLICY_LEVELS}")
    mask = mask.float()
    valid = mask > 0
    log_ratio = ((proximal_logprobs - behaviour_logprobs).detach().float()) * mask
    if level == "token":
        log_weight = log_ratio
    else:
        summed = log_ratio.sum(-1)
        if level == "geometric":
            summed = summed / mask.sum(-1).clamp(min=1.0)
        log_weight = summed[:, None].expand_as(log_ratio)
    ratio = torch.exp(log_weight.clamp(-_LOG_CLAMP, _LOG_CLAMP)) * mask
    if correction == "none":
        weights = mask.clone()
    elif correction == "tis":
        weights = ratio.clamp(max=cap)
    elif correction == "mis":
        weights = ratio * ((ratio >= low) & (ratio <= high)).float()
    else:  # decoupled
        weights = ratio * (ratio <= cap).float()
    with torch.no_grad():
        bounded = (weights != ratio) & valid
        count = max(int(valid.sum()), 1)
        stats = {
            "is_ratio_mean": masked_mean(ratio, mask).item(),
            "is_ratio_min": ratio[valid].min().item() if valid.any() else 1.0,
            "is_ratio_max": ratio[valid].max().item() if valid.any() else 1.0,
            "is_bounded_frac": float(bounded.sum()) / count,
            "mismatch_kl": masked_mean(kl(behaviour_logprobs.detach().float(),
                                          proximal_logprobs.detach().float(), "k3"),
                                       mask).item(),
        }
    return weights, stats
