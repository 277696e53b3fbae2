"""Tensor plumbing shared by stages: how a (prompt, response) batch enters a model.

Layout: ``prompt_ids [N, Lp]`` left-padded (``prompt_mask``), ``response_ids [N, Lr]``
right-padded (``response_mask``). The model sees ``cat(prompt, response)`` with positions
counted over real tokens only, so padding never shifts a sample's positions; the logits
at position ``Lp + t - 1`` predict response token ``t``.
"""

from __future__ import annotations

import hashlib

import torch

from rlhfflow import ops
from rlhfflow.stages.base import Batch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens: ``[N, L]`` from a 0/1 mask ``[N, L]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_inputs(batch: Batch, device: str | torch.device = "cpu"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(input_ids [N, Lp+Lr], attention_mask, position_ids, Lp)`` for a batch."""
    prompt_ids, response_ids = batch["prompt_ids"], batch["response_ids"]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    mask = torch.cat([batch["prompt_mask"].long(), batch["response_mask"].long()], dim=1)
    mask = mask.to(device)
    return input_ids, mask, position_ids(mask), prompt_ids.shape[1]


def response_logits(module: torch.nn.Module, batch: Batch, temperature: float = 1.0
                    ) -> torch.Tensor:
    """Logits ``[N, Lr, V]`` (float32, divided by ``temperature``) predicting each
    response token."""
    device = next(module.parameters()).device
    input_ids, mask, positions, prompt_len = sequence_inputs(batch, device)
    response_len = batch["response_ids"].shape[1]
    if _keeps_logits(module):
        # the LM head only where a response token is predicted (positions Lp-1 ..
        # Lp+Lr-2): with a real vocabulary the head is a large share of the forward, and
        # the prompt's logits were computed only to be thrown away (same values, tested)
        out = module(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                     use_cache=False, logits_to_keep=response_len + 1)
        logits = out.logits[:, :response_len].float()
    else:
        out = module(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                     use_cache=False)
        logits = out.logits[:, prompt_len - 1: prompt_len - 1 + response_len].float()
    return logits / temperature if temperature != 1.0 else logits


def last_logits_kwargs(module: torch.nn.Module) -> dict[str, int]:
    """Forward keywords that compute the LM head at the last position only (a prefill
    needs no more): at a real vocabulary the head over every prompt token is a fifth of
    a prefill's work (SmolLM2-135M, 49k tokens)."""
    return {"logits_to_keep": 1} if _keeps_logits(module) else {}


def _keeps_logits(module: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs)."""
    import inspect

    forward = type(module).forward
    if forward not in _KEEPS_LOGITS:
        _KEEPS_LOGITS[forward] = "logits_to_keep" in inspect.signature(forward).parameters
    return _KEEPS_LOGITS[forward]


_KEEPS_LOGITS: dict = {}


def response_logprobs(module: torch.nn.Module, batch: Batch, temperature: float = 1.0
                      ) -> torch.Tensor:
    """Per-token log-probs ``[N, Lr]`` of the response under ``module``; 0 on padding."""
    logits = response_logits(module, batch, temperature)
    labels = batch["response_ids"].to(logits.device)
    logprobs = ops.logprobs_from_logits(logits, labels)
    return logprobs * batch["response_mask"].to(logprobs.device)


def response_values(module: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Per-token values ``[N, Lr]`` from a value-head model, aligned with the log-probs
    (the value of the state before each response token); 0 on padding."""
    device = next(module.parameters()).device
    input_ids, mask, positions, prompt_len = sequence_inputs(batch, device)
    response_len = batch["response_ids"].shape[1]
    out = module(input_ids=input_ids, attention_mask=mask, position_ids=positions)
    values = out.logits[..., 0].float()[:, prompt_len - 1: prompt_len - 1 + response_len]
    return values * batch["response_mask"].to(values.device)


def minibatch_indices(rows: int, minibatches: int, generator: torch.Generator,
                      shuffle: bool = True) -> list[torch.Tensor]:
    """Split ``range(rows)`` into ``minibatches`` near-equal index sets."""
    order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
    return [chunk for chunk in torch.tensor_split(order, minibatches) if len(chunk)]


def stage_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from integers and strings (``hash()`` is salted per process,
    so it cannot be used for anything that must repeat across workers)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        if isinstance(part, str):
            part = int.from_bytes(hashlib.blake2b(part.encode(), digest_size=8).digest(),
                                  "little")
        value = _splitmix64(value ^ (int(part) & 0xFFFFFFFFFFFFFFFF))
    return value & 0x7FFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)
