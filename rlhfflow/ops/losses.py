"""Losses: veRL's aggregations of a per-token loss, the PPO/GSPO policy loss, the clipped
value loss and the entropy bonus. The shape legend is :mod:`rlhfflow.ops.core`'s.
"""

from __future__ import annotations

import torch

from rlhfflow.ops.core import LOG_RATIO_CLAMP, kl, masked_mean

# veRL's agg_loss modes (plus token-sum); the first two are rlhfflow's originals.
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum",
             "seq-mean-token-sum-norm")
IS_LEVELS = ("token", "sequence")


def aggregate_loss(loss_tok: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
                   count: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar, as veRL's ``agg_loss``.

    Modes (``S_b`` = sum of sequence b's valid per-token losses, ``n_b`` its valid tokens):
        token-mean:              sum_b S_b / sum_b n_b      (every token weighs the same)
        seq-mean-token-mean:     mean over sequences with n_b > 0 of S_b / n_b
        token-sum:               sum_b S_b
        seq-mean-token-sum:      mean over sequences with n_b > 0 of S_b
        seq-mean-token-sum-norm: sum_b S_b / response_length (Dr. GRPO's constant
                                 normaliser; veRL's default ``loss_scale_factor``)

    Each mode is an additive numerator over a divisor, so a data-parallel shard passes
    the whole batch's divisor as ``count`` (``loss_count``) and the shards' losses add
    up to the batch's.

    Args:
        loss_tok: `(torch.Tensor)` shape: (bs, response_length)
        mask: `(torch.Tensor)` shape: (bs, response_length)
        agg: one of ``LOSS_AGGS``
        count: the divisor over the whole batch (``loss_count``); None uses this batch's
            own (for ``seq-mean-token-sum-norm``: ``response_length``)

    Returns:
        loss: scalar tensor; an all-zero mask gives 0
    """
    if agg == "token-mean":
        return masked_mean(loss_tok, mask, count=count)
    if agg == "seq-mean-token-mean":
        # each sequence weighs the same, whatever its length
        seq_mean = masked_mean(loss_tok, mask, dim=-1)
        has_tokens = mask.bool().any(dim=-1)
        return masked_mean(seq_mean, has_tokens, count=count)
    valid = torch.broadcast_to(mask.bool(), loss_tok.shape)
    # where() rather than x * mask: masked positions may hold inf/NaN.
    total = torch.where(valid, loss_tok, torch.zeros((), dtype=loss_tok.dtype,
                                                      device=loss_tok.device))
    if agg == "token-sum":
        return total.sum() / (1.0 if count is None else count)
    if agg == "seq-mean-token-sum":
        seq_sum = total.sum(dim=-1)
        return masked_mean(seq_sum, valid.any(dim=-1), count=count)
    if agg == "seq-mean-token-sum-norm":
        return total.sum() / (float(loss_tok.shape[-1]) if count is None else count)
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {LOSS_AGGS}")


def loss_count(mask: torch.Tensor, agg: str = "token-mean",
               scale_factor: float | None = None) -> float:
    """The divisor ``agg`` uses over ``mask`` (bs, response_length): valid tokens for
    ``token-mean``, sequences with a valid token for the ``seq-mean-*`` modes, 1 for
    ``token-sum``, and ``scale_factor`` (default ``response_length``) for
    ``seq-mean-token-sum-norm``. Computed over a whole batch and passed as ``count`` to
    each data-parallel shard's loss."""
    if agg == "token-mean":
        return float(mask.bool().sum())
    if agg == "token-sum":
        return 1.0
    if agg == "seq-mean-token-sum-norm":
        return float(mask.shape[-1]) if scale_factor is None else float(scale_factor)
    if agg not in LOSS_AGGS:
        raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {LOSS_AGGS}")
    return float(mask.bool().any(dim=-1).sum())


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    count: float | None = None,
    level: str = "token",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss (Schulman et al., 2017), optionally dual-clipped (Ye et al.).

    Per token, with ``ratio = exp(logprobs - old_logprobs)`` and advantage ``A``:
        loss = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
    With ``dual_clip = c > 1`` and ``A < 0`` the loss is further capped at ``-A * c`` so a
    huge ratio on a bad action cannot blow up the update.

    With ``level="sequence"`` (GSPO, Zheng et al. 2025; TRL's
    ``importance_sampling_level="sequence"``) every token of a sequence uses the
    sequence's ratio ``s = exp(mean over its valid tokens of (logprobs - old_logprobs))``,
    written as ``sg[s] * pi / sg[pi]`` (veRL's GSPO-token form): the forward value is
    ``s`` and each token's gradient is ``s * grad log pi``. Under ``seq-mean-token-mean``
    this is GSPO's objective and gradient exactly.

    Args:
        logprobs: `(torch.Tensor)` shape: (bs, response_length), current policy; gradients
            flow through this argument only
        old_logprobs: `(torch.Tensor)` shape: (bs, response_length), behaviour policy
        advantages: `(torch.Tensor)` shape: (bs, response_length)
        mask: `(torch.Tensor)` shape: (bs, response_length)
        clip_low, clip_high: asymmetric clip range [1 - clip_low, 1 + clip_high] (DAPO style)
        dual_clip: lower bound ``c`` of dual-clip PPO, must be > 1; None disables it
        agg: how per-token losses become a scalar (``aggregate_loss``; ``LOSS_AGGS``)
        count: the divisor of ``agg`` over the whole batch when this is one data-parallel
            shard of it (``loss_count``); None divides by this batch's own
        level: ``"token"`` or ``"sequence"`` importance ratios
        weights: `(torch.Tensor)` shape: (bs, response_length), an off-policy correction's
            importance weights (``rlhfflow.ops.offpolicy``), each token's loss multiplied
            by its (detached) weight; None: 1 everywhere

    Returns:
        loss: scalar tensor
        stats: python floats: ``clip_frac`` (fraction of valid tokens where the clipped
            branch is active), ``approx_kl`` (k3 estimate of KL(old || new), i.e.
            ``masked_mean(exp(lr) - 1 - lr)`` with per-token ``lr = logprobs -
            old_logprobs``), ``ratio_mean``, and with ``dual_clip`` ``clip_frac_lower``
            (fraction of valid tokens where the dual-clip cap is active)
    """
    if agg not in LOSS_AGGS:
        raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {LOSS_AGGS}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance sampling level {level!r}; expected one of "
                         f"{IS_LEVELS}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()

    log_ratio = logprobs - old_logprobs
    if level == "sequence":
        seq_log_ratio = masked_mean(log_ratio.detach(), mask, dim=-1)
        log_ratio = logprobs - logprobs.detach() + seq_log_ratio[:, None]
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(pg_unclipped, pg_clipped)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        capped = torch.minimum(loss_tok, cap)
        dual_active = (advantages < 0) & (loss_tok > cap)
        loss_tok = torch.where(advantages < 0, capped, loss_tok)
    if weights is not None:
        loss_tok = loss_tok * weights.detach()

    loss = aggregate_loss(loss_tok, mask, agg, count)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((pg_clipped > pg_unclipped).float(), mask).item(),
            "approx_kl": masked_mean(kl(old_logprobs, logprobs, "k3"), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
        if dual_clip is not None:
            stats["clip_frac_lower"] = masked_mean(dual_active.float(), mask).item()
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    count: float | None = None,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss, clipped around the values predicted at rollout time.

    ``loss = 0.5 * agg(max((v - R)^2, (v_clipped - R)^2))`` with
    ``v_clipped = clamp(v, old - clip, old + clip)``; ``clip=None`` gives the plain
    ``0.5 * agg((v - R)^2)``. Taking the max makes clipping pessimistic: the critic
    cannot profit from moving further than ``clip`` from its old estimate.

    Args:
        values: `(torch.Tensor)` shape: (bs, response_length), current critic output
        old_values: `(torch.Tensor)` shape: (bs, response_length), critic at rollout time
        returns: `(torch.Tensor)` shape: (bs, response_length), targets (e.g. from ``gae``)
        mask: `(torch.Tensor)` shape: (bs, response_length)
        clip: clip range for the value update, or None
        count: the divisor of ``agg`` over the whole batch when this is one data-parallel
            shard of it (``loss_count``)
        agg: how per-token losses become a scalar (``aggregate_loss``; ``LOSS_AGGS``)

    Returns:
        loss: scalar tensor
        stats: python floats ``value_clip_frac`` (fraction of valid tokens where the clipped
            term was the larger one) and ``values_mean``
    """
    old_values, returns = old_values.detach(), returns.detach()
    err_unclipped = (values - returns).square()
    if clip is None:
        loss_tok = err_unclipped
        clipped = torch.zeros_like(err_unclipped, dtype=torch.bool)
    else:
        # Clamp v itself, not old + clamp(v - old): inside the range the latter is often
        # not bit-equal to v in float32, and the strict ">" below then counted unclipped
        # tokens as clipped (up to 0.1 too high on random inputs).
        v_clipped = torch.clamp(values, old_values - clip, old_values + clip)
        err_clipped = (v_clipped - returns).square()
        loss_tok = torch.maximum(err_unclipped, err_clipped)
        clipped = err_clipped > err_unclipped
    loss = 0.5 * aggregate_loss(loss_tok, mask, agg, count)
    with torch.no_grad():
        stats = {
            "value_clip_frac": masked_mean(clipped.float(), mask).item(),
            "values_mean": masked_mean(values, mask).item(),
        }
    return loss, stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of ``softmax(logits)``.

    Args:
        logits: `(torch.Tensor)` shape: (bs, response_length, vocab_size)

    Returns:
        entropy: `(torch.Tensor)` float32, shape: (bs, response_length)
    """
    logits = logits.float()
    # H = logsumexp(z) - sum(p * z): never takes log(p), so p == 0 cannot produce NaN.
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy(logits: torch.Tensor, mask: torch.Tensor | None = None,
            count: float | None = None, agg: str = "token-mean") -> torch.Tensor:
    """Per-token entropy of ``softmax(logits)`` over valid tokens, aggregated by ``agg``.

    Args:
        logits: `(torch.Tensor)` shape: (bs, response_length, vocab_size)
        mask: `(torch.Tensor)` shape: (bs, response_length), or None for all tokens
        count: the divisor of ``agg`` over the whole batch when this is a data-parallel
            shard of it (``loss_count``)
        agg: how per-token entropies become a scalar (``aggregate_loss``), the same mode
            as the policy loss the bonus is added to

    Returns:
        entropy: scalar tensor
    """
    ent = entropy_from_logits(logits)
    if mask is None:
        return ent.mean() if agg == "token-mean" else aggregate_loss(ent, torch.ones_like(ent),
                                                                     agg, count)
    return aggregate_loss(ent, mask, agg, count)
