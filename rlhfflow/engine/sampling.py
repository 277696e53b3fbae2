"""The sampler: one token per row from logits, exact categorical sampling by inverse CDF.

Every row draws its uniforms from its own generator seeded by ``(seed, iteration,
prompt_index, sample_index)`` (:func:`sample_uniforms`), so a prompt's response does not
depend on the batch it lands in. Plain decoding (the ``generate`` stage) and speculative
verification (:mod:`rlhfflow.engine.decoding`) sample with the same arithmetic.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlhfflow import ops
from rlhfflow.engine.forward import stage_seed


class SamplingParams(Protocol):
    """What the sampler reads of a stage's parameters (``GenerateParams`` has them)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. ``logits [N, V]``."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the tokens before it already cover top_p (keeps at least one)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def row_generators(seed: int, iteration: int, prompt_index: torch.Tensor,
                   sample_index: torch.Tensor) -> list[torch.Generator]:
    """Each row's own random generator: the stream its sampled tokens draw from, the n-th
    token of the row's response (across turns and calls) the n-th uniform."""
    return [torch.Generator().manual_seed(stage_seed(seed, iteration, p, s))
            for p, s in zip(prompt_index.tolist(), sample_index.tolist(), strict=True)]


def sample_uniforms(seed: int, iteration: int, prompt_index: torch.Tensor,
                    sample_index: torch.Tensor, steps: int) -> torch.Tensor:
    """One uniform per row and step ``[N, steps]``, each row from its own generator."""
    rows = [torch.rand(steps, generator=gen, dtype=torch.float64)
            for gen in row_generators(seed, iteration, prompt_index, sample_index)]
    return torch.stack(rows) if rows else torch.zeros(0, steps, dtype=torch.float64)


def sample_step(logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams
                ) -> torch.Tensor:
    """Sample one token per row from ``logits [N, V]`` with ``uniforms [N]``."""
    if params.greedy:
        return logits.argmax(-1)
    filtered = filter_logits(ops.tempered(logits, params.temperature), params.top_k, params.top_p)
    probs = torch.softmax(filtered.double(), dim=-1)
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    token = torch.searchsorted(cdf, target).squeeze(-1)
    # searchsorted may land on a zero-probability token after the last positive one
    return token.clamp(max=logits.shape[-1] - 1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` (float64, unnormalised) with ``uniforms [N]``;
    the same arithmetic as :func:`sample_step`."""
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target).squeeze(-1).clamp(max=probs.shape[-1] - 1)
