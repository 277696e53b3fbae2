"""Gradient checkpointing: each decoder layer's activations recomputed in the backward
pass instead of kept from the forward (``models.NAME.gradient_checkpointing``).

transformers' own switch (``gradient_checkpointing_enable``) acts only in train mode,
and rlhfflow trains its models in eval mode (no dropout: the log-probs of a training
forward are those the inference stages computed). So the layers are checkpointed here,
whatever the mode, with torch's non-reentrant ``torch.utils.checkpoint`` (it keeps the
RNG and autocast state of the forward for the recomputation): the lean forward
(``rlhfflow.engine.lean``) checkpoints its own layer loop, and a model on transformers'
forward gets each decoder layer's ``forward`` wrapped. Only forwards that build a graph
(grad enabled) and keep no KV cache are checkpointed; inference is unchanged.

The gradients are those of the plain forward (the same operations run again on the
same inputs; ``tests/engine/test_recompute.py``), and the saved activations shrink from every
layer's intermediates to each layer's input.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.utils.checkpoint import checkpoint

from rlhfflow.engine.lean import transformers_model

log = logging.getLogger(__name__)
#: The attribute the lean forward reads: checkpoint each layer of the loop.
LEAN_FLAG = "_rlhfflow_recompute"


def enable(module: torch.nn.Module) -> str | None:
    """Checkpoint ``module``'s decoder layers from now on; how (``"lean"``: the lean
    forward's loop, ``"layers"``: transformers' layers wrapped), or None where no
    decoder layer was found (said once in the log; the model trains without it)."""
    inner = transformers_model(module)  # under peft's wrapper, the lean one
    if getattr(type(inner), "_lean_base", None) is not None:
        setattr(inner, LEAN_FLAG, True)
    layers = decoder_layers(module)
    for layer in layers:  # the lean forward falls back to these in some calls
        if not getattr(layer.forward, "_recomputed", False):
            layer.forward = _checkpointed(layer.forward)
    if getattr(inner, LEAN_FLAG, False):
        return "lean"
    if layers:
        return "layers"
    _warn_once(type(module).__name__)
    return None


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model (its ``GradientCheckpointingLayer``s)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]


def _checkpointed(forward):
    """``forward`` run under ``checkpoint`` when it builds a graph and keeps no cache."""
    @functools.wraps(forward)
    def layer_forward(*args, **kwargs):
        if not torch.is_grad_enabled() or _has_cache(args, kwargs):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer_forward._recomputed = True
    return layer_forward


def _has_cache(args: tuple, kwargs: dict) -> bool:
    """Whether a layer call gets a KV cache: the forward updates it, and the
    recomputation would update it again."""
    from transformers import Cache

    return any(isinstance(value, Cache) for value in (*args, *kwargs.values()))


@functools.cache
def _warn_once(class_name: str) -> None:
    log.warning("gradient_checkpointing: %s has no transformers decoder layers to "
                "checkpoint; it trains without", class_name)
