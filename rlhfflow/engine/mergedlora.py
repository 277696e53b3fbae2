"""A LoRA layer computed from its merged weight ``W + scaling * B A``: the weight, made
again only where the layer changed (``merged_weights``), and the autograd function whose
gradients are the adapters' path's (``MergedLoRA``). The lean forward
(``rlhfflow.engine.lean``) takes them within ``merged_adapters`` and ``training``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from rlhfflow.engine.cpukernels import onednn_linear


def is_lora(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is peft's LoRA ``Linear`` (not a subclass: quantized layers)."""
    return type(layer) is _lora_linear()


@functools.cache
def _lora_linear() -> type | None:
    """peft's LoRA ``Linear`` class, or None without peft (the ``lora`` extra)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


class MergedLoRA(torch.autograd.Function):
    """A LoRA layer ``y = x W^T + s (x A^T) B^T`` computed as ``x M^T`` with its merged
    weight ``M = W + s B A``, and the gradients the adapters' path has:
    ``dx = dy M``, ``dA = s (dy B)^T x``, ``dB = s dy^T (x A^T)``. ``M`` is saved for the
    backward pass: merging it again in place before then (``_Merged``) makes autograd
    refuse the backward rather than compute it from other weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, merged: torch.Tensor, down: torch.Tensor,
                up: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x, merged, down, up)
        ctx.scale = scale
        return onednn_linear(x, merged)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, merged, down, up = ctx.saved_tensors
        rows_x, rows_grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = onednn_linear(grad, merged.t()) if ctx.needs_input_grad[0] else None
        grad_down = grad_up = None
        if ctx.needs_input_grad[2]:
            grad_down = rows_grad.mm(up).t().mm(rows_x).mul_(ctx.scale)
        if ctx.needs_input_grad[3]:
            grad_up = rows_grad.t().mm(rows_x.mm(down.t())).mul_(ctx.scale)
        return grad_x, None, grad_down, grad_up, None


class _Merged:
    """A LoRA layer's merged weight and what it was made from: the base weight's storage
    and version, copies of the adapters (compared, not versioned: a ``.data`` copy from
    a shadow or DeepSpeed leaves no version) and their scalings."""

    def __init__(self, layer: torch.nn.Module, adapters: list[str],
                 old: _Merged | None) -> None:
        base = layer.base_layer.weight
        self.key = self._key(layer, adapters)
        self.adapters = [(layer.lora_B[a].weight.detach().clone(),
                          layer.lora_A[a].weight.detach().clone()) for a in adapters]
        weight = old.weight if old is not None and old.weight.shape == base.shape else None
        with torch.no_grad():
            weight = base.detach().clone() if weight is None else weight.copy_(base)
            for (up, down), scale in zip(self.adapters, self.key[3], strict=True):
                weight.addmm_(up.to(weight.dtype), down.to(weight.dtype), alpha=scale)
        self.weight = weight

    @staticmethod
    def _key(layer: torch.nn.Module, adapters: list[str]) -> tuple:
        """The layer's state besides the adapters' values: the base weight's storage and
        version, the adapters' names and scalings."""
        base = layer.base_layer.weight
        return (base.data_ptr(), base._version, tuple(adapters),
                tuple(layer.scaling[a] for a in adapters))

    def current(self, layer: torch.nn.Module, adapters: list[str]) -> bool:
        """Whether the layer is still what this weight was merged from."""
        return self._key(layer, adapters) == self.key and all(
            torch.equal(layer.lora_B[a].weight, up) and torch.equal(layer.lora_A[a].weight, down)
            for a, (up, down) in zip(adapters, self.adapters, strict=True))


def merged_weights(module: torch.nn.Module, base: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The merged weight of each LoRA layer of ``module`` the lean forward reads, made
    again where its layer changed; kept in ``module.__dict__`` (not a parameter or
    buffer: never saved, moved or trained)."""
    cache: dict[str, _Merged] = module.__dict__.setdefault("_lean_merged", {})
    weights = {}
    for name, layer, adapters in mergeable_layers(base):
        entry = cache.get(name)
        if entry is None or not entry.current(layer, adapters):
            entry = cache[name] = _Merged(layer, adapters, entry)
        weights[id(layer)] = entry.weight
    return weights


def mergeable_layers(base: torch.nn.Module
                      ) -> Iterator[tuple[str, torch.nn.Module, list[str]]]:
    """``(name, layer, adapters)`` for each LoRA layer of transformers model ``base`` with
    active adapters a merged weight can compute (``_mergeable``)."""
    for name, layer in base.named_modules():
        adapters = _mergeable(layer) if is_lora(layer) else []
        if adapters:
            yield name, layer, adapters


def _mergeable(layer: torch.nn.Module) -> list[str]:
    """The active adapters of LoRA ``layer`` that a merged weight computes as the
    adapters' path does; none where it cannot: adapters merged into the weights, switched
    off or of a variant, active dropout (train mode), a base partitioned by ZeRO-3."""
    if layer.merged or layer.disable_adapters or layer.lora_variant \
            or hasattr(layer.base_layer.weight, "ds_id"):  # partitioned by ZeRO-3
        return []
    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    if layer.training and any(not isinstance(layer.lora_dropout[a], torch.nn.Identity)
                              for a in adapters):
        return []
    return adapters
