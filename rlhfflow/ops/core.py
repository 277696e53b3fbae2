"""Pure, vectorised torch functions for RLHF: log-probs, KL, advantages, losses.

Shape legend used in the docstrings:
    B: batch size (sequences), T: response length (tokens), V: vocabulary size,
    N: number of samples for outcome-level (one score per sample) estimators.

Masks are 0/1 (bool, int or float) with 1 on valid response tokens. Nothing here
touches I/O or the rest of rlhfflow, so every function can run inside any Dask task.
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3")
GROUP_MODES = ("grpo", "rloo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
# veRL's agg_loss modes (plus token-sum); the first two are rlhfflow's originals.
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum",
             "seq-mean-token-sum-norm")
IS_LEVELS = ("token", "sequence")

# exp() of a log-ratio beyond this overflows float32 or dominates the batch; veRL uses 20 too.
_LOG_RATIO_CLAMP = 20.0


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Result dtype of ``tensors``, promoted to float32 if it is not floating point."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype if dtype.is_floating_point else torch.float32


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``; ``logits`` itself at temperature 1 (the same values: a
    division by 1 is exact, and a copy of ``(B, V)`` logits per decode step is not free)."""
    return logits if temperature == 1.0 else logits / temperature


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``.

    Args:
        logits: `(torch.Tensor)` shape: (bs, response_length, vocab_size)
        labels: `(torch.Tensor)` int64, shape: (bs, response_length)

    Returns:
        logprobs: `(torch.Tensor)` float32, shape: (bs, response_length)
    """
    # bf16/fp16 log_softmax loses several digits on large vocabularies; PPO ratios need them.
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimator of KL(pi || ref) from samples drawn from pi (Schulman, 2020).

    With ``lr = logprobs - ref_logprobs``:
        k1 = lr                        (unbiased, high variance, can be negative)
        k2 = 0.5 * lr**2               (biased, low variance, >= 0)
        k3 = exp(-lr) - 1 + lr         (unbiased, low variance, >= 0; "low_var_kl")

    Args:
        logprobs: `(torch.Tensor)` shape: (bs, response_length), log pi of the sampled tokens
        ref_logprobs: `(torch.Tensor)` shape: (bs, response_length), log ref of the same tokens
        kind: one of ``"k1"``, ``"k2"``, ``"k3"``

    Returns:
        kl: `(torch.Tensor)` shape: (bs, response_length)
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        # Clamp only the exponent: exp(20) is finite in fp32 and the result stays >= 0.
        neg = torch.clamp(-log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.exp(neg) - 1 + log_ratio
    raise ValueError(f"unknown kl kind {kind!r}; expected one of {KL_KINDS}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                count: float | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1.

    Args:
        x: `(torch.Tensor)` any shape, e.g. (bs, response_length)
        mask: `(torch.Tensor)` broadcastable to ``x.shape``
        dim: reduce over this dim only; ``None`` reduces over everything
        count: divide the masked sum by this instead of the number of valid positions
            (``dim=None`` only): the count over a whole batch of which ``x`` is one
            data-parallel shard, so the shards' terms add up to the batch's mean

    Returns:
        mean: scalar tensor if ``dim`` is None, else ``x`` with ``dim`` reduced.
        An all-zero mask gives 0 (not NaN), so empty micro-batches do not poison a sum.
    """
    valid = torch.broadcast_to(mask.bool(), x.shape)
    # where() rather than x * mask: masked positions may hold inf/NaN (e.g. padded logits).
    total = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        if count is not None:
            return total.sum() / max(float(count), 1.0)
        return total.sum() / valid.to(_float_dtype(x)).sum().clamp_min(1.0)
    valid_count = valid.to(_float_dtype(x))
    return total.sum(dim) / valid_count.sum(dim).clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over positions where ``mask`` is 1 (two-pass, for stability).

    Args:
        x: `(torch.Tensor)` any shape
        mask: `(torch.Tensor)` broadcastable to ``x.shape``
        unbiased: apply Bessel's correction n / (n - 1); skipped when n <= 1

    Returns:
        var: scalar tensor (0 when fewer than two valid positions)
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    if unbiased:
        n = torch.broadcast_to(mask.bool(), x.shape).sum().to(var.dtype)
        # A tensor-side where keeps this free of host syncs (no `if n > 1`).
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1.0), var)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean) using statistics of valid positions.

    Args:
        x: `(torch.Tensor)` any shape, e.g. (bs, response_length)
        mask: `(torch.Tensor)` broadcastable to ``x.shape``
        shift_mean: if False the original mean is added back (only the scale changes)
        eps: added to the variance before the square root

    Returns:
        whitened: `(torch.Tensor)` shape of ``x``. Positions where ``mask`` is 0 are set to 0,
        so padding never carries a (meaningless) whitened value into a later sum.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    valid = torch.broadcast_to(mask.bool(), x.shape)
    return torch.where(valid, whitened, torch.zeros((), dtype=whitened.dtype, device=x.device))


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
    dtype = _float_dtype(rewards, values)
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
    x = scores.to(_float_dtype(scores))
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
    log_ratio = torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
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


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Dense per-token rewards: a KL penalty everywhere, the sequence score at the end.

    ``r[b, t] = -kl_coef * kl[b, t]`` on valid tokens, plus ``scores[b]`` at the last
    position where ``mask[b] == 1`` (found robustly, so left or interior padding also
    works). Masked positions are 0; a sequence with no valid token is all zeros.

    Args:
        scores: `(torch.Tensor)` shape: (bs,), one scalar reward per sequence
        kl: `(torch.Tensor)` shape: (bs, response_length), per-token KL estimate
        mask: `(torch.Tensor)` shape: (bs, response_length)
        kl_coef: weight of the KL penalty

    Returns:
        rewards: `(torch.Tensor)` shape: (bs, response_length)
    """
    valid = mask.bool()
    dtype = _float_dtype(kl, scores)
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    rewards = torch.where(valid, -kl_coef * kl.to(dtype), zero)
    # positions 1..T are strictly increasing, so argmax picks the LAST valid token.
    positions = torch.arange(1, valid.shape[-1] + 1, device=valid.device)
    last = (valid.long() * positions).argmax(dim=-1, keepdim=True)
    bonus = torch.where(valid.any(dim=-1), scores.to(dtype), zero).unsqueeze(-1)
    return rewards + torch.zeros_like(rewards).scatter(-1, last, bonus)
