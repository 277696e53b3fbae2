"""Pure, vectorised torch functions for RLHF: log-probs, KL estimators, masked statistics
and per-token rewards, the pieces the estimators (:mod:`rlhfflow.ops.advantages`) and the
losses (:mod:`rlhfflow.ops.losses`) are built from.

Shape legend used in the docstrings:
    B: batch size (sequences), T: response length (tokens), V: vocabulary size,
    N: number of samples for outcome-level (one score per sample) estimators.

Masks are 0/1 (bool, int or float) with 1 on valid response tokens. Nothing here
touches I/O or the rest of rlhfflow, so every function can run inside any Dask task.
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3")

# exp() of a log-ratio beyond this overflows float32 or dominates the batch; veRL uses 20 too.
LOG_RATIO_CLAMP = 20.0


def float_dtype(*tensors: torch.Tensor) -> torch.dtype:
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
        neg = torch.clamp(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
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
        return total.sum() / valid.to(float_dtype(x)).sum().clamp_min(1.0)
    valid_count = valid.to(float_dtype(x))
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
    dtype = float_dtype(kl, scores)
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    rewards = torch.where(valid, -kl_coef * kl.to(dtype), zero)
    # positions 1..T are strictly increasing, so argmax picks the LAST valid token.
    positions = torch.arange(1, valid.shape[-1] + 1, device=valid.device)
    last = (valid.long() * positions).argmax(dim=-1, keepdim=True)
    bonus = torch.where(valid.any(dim=-1), scores.to(dtype), zero).unsqueeze(-1)
    return rewards + torch.zeros_like(rewards).scatter(-1, last, bonus)
