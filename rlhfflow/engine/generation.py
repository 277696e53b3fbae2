"""The plain decode loop (:func:`generate`) and where a response ends (EOS ids, stop
strings), shared by the stages that sample: ``generate``, ``evaluate`` and ReMax's greedy
baseline. Speculative decoding, which keeps the same sampling arithmetic, is
:mod:`rlhfflow.engine.speculative`; multi-turn episodes, :mod:`rlhfflow.engine.episodes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhfflow import ops
from rlhfflow.engine.forward import cache_kwargs, output_cache, prefill
from rlhfflow.engine.sampling import SamplingParams, sample_step


class DecodeParams(SamplingParams, Protocol):
    """What the decode loop reads of a stage's parameters (``GenerateParams`` has them)."""

    max_new_tokens: int


@dataclass(frozen=True)
class Sampling:
    """Decode settings for a stage that samples for its own use (an evaluation, a greedy
    baseline) rather than with ``GenerateParams``; the same defaults."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False


@torch.no_grad()
def generate(module: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             uniforms: torch.Tensor, params: DecodeParams,
             eos_id: int | Sequence[int] | None, pad_id: int) -> dict[str, torch.Tensor]:
    """Sample up to ``max_new_tokens`` per left-padded prompt with a KV cache.

    Returns ``response_ids [N, max_new_tokens]`` (right-padded with ``pad_id``),
    ``response_mask`` (1 up to and including EOS) and ``sample_logprobs``: the log-prob
    of each sampled token under ``log_softmax(logits / temperature)`` (unfiltered, the
    distribution the policy loss uses).
    """
    device = next(module.parameters()).device
    rows, steps = prompt_ids.shape[0], params.max_new_tokens
    mask = prompt_mask.long().to(device)
    cache, logits = prefill(module, prompt_ids, prompt_mask, device)
    next_pos = mask.sum(-1, keepdim=True)
    tokens = torch.full((rows, steps), pad_id, dtype=torch.long)
    logprobs = torch.zeros(rows, steps)
    response_mask = torch.zeros(rows, steps, dtype=torch.int8)
    alive = torch.ones(rows, dtype=torch.bool)  # no EOS yet: this step's token is real
    for t in range(steps):
        token = sample_step(logits, uniforms[:, t], params).cpu()
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        lp = torch.log_softmax(ops.tempered(logits, params.temperature), -1).cpu()
        logprobs[:, t] = lp.gather(-1, token[:, None]).squeeze(-1) * alive
        tokens[:, t] = token
        response_mask[:, t] = alive
        if eos_id is not None:
            alive &= ~torch.isin(token, torch.as_tensor(eos_id))
        if not alive.any() or t == steps - 1:
            break
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=device)], dim=1)
        out = module(input_ids=token[:, None].to(device), attention_mask=mask,
                     position_ids=next_pos, use_cache=True, **cache_kwargs(module, cache))
        cache, logits = output_cache(out), out.logits[:, -1].float()
        next_pos = next_pos + 1
    return {"response_ids": tokens, "response_mask": response_mask,
            "sample_logprobs": logprobs}


def eos_ids(module: torch.nn.Module, tokenizer) -> list[int] | None:
    """Every EOS id of a model: the tokenizer's and its ``generation_config``'s (an int or
    a list: chat models often end a turn with a token that is not the tokenizer's EOS,
    e.g. ``<|im_end|>``)."""
    ids = [tokenizer.eos_token_id]
    config_eos = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    ids += config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]
    ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return ids or None


def cut_at_stop(out: dict[str, torch.Tensor], tokenizer, stops: Sequence[str],
                pad_id: int) -> None:
    """End each response at the token that completes its first stop string (kept, as
    transformers' ``stop_strings`` does): later tokens are padded and masked out. Done
    after sampling: tokens after a stop never influence those before it, so the kept
    tokens, log-probs and mask are those of a loop that had stopped there."""
    for row in range(out["response_ids"].shape[0]):
        length = int(out["response_mask"][row].sum())
        ids = out["response_ids"][row, :length].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not any(stop in text for stop in stops):
            continue
        # the shortest prefix whose text holds a stop string (decoded prefixes grow)
        low, high = 1, length
        while low < high:
            mid = (low + high) // 2
            prefix = tokenizer.decode(ids[:mid], skip_special_tokens=True)
            if any(stop in prefix for stop in stops):
                high = mid
            else:
                low = mid + 1
        out["response_ids"][row, low:] = pad_id
        out["response_mask"][row, low:] = 0
        out["sample_logprobs"][row, low:] = 0.0
