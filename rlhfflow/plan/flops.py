"""Useful model FLOPs of an iteration, counted from the models' shapes and the tokens the
iteration processed: the numerator of MFU (model FLOPs utilisation).

A forward pass over a sequence of ``S`` real tokens costs

    2 * N * S                       the matrix products with the weights
  + 4 * L * A * S * (S + 1) / 2     causal attention: scores and the weighted sum

where ``N`` is ``ModelShape.matmul_params`` (every matrix weight a token is multiplied
by: the non-embedding weights and the output head, tied or not), ``L`` the layers and
``A`` the attention width (query heads x head width); token ``t`` attends to ``t`` keys.
A stage does ``PlanHints.passes`` such forwards per token: 1 for log-probs, values,
scoring with a model and generation (a KV-cached generation does the same products: the
prefill, then one token at a time over the cache), 3 per epoch for training (the
backward pass is two forwards' worth of products: the gradients of the inputs and those
of the weights). A LoRA model's frozen base weights get no weight gradient: its forward
also multiplies by the adapters (``ModelShape.adapters``: ``N_a``), and a training step's
weight products are ``2 N + 2 N_a`` forward, ``2 N`` for the input gradients through the
base and ``4 N_a`` for the adapters' backward, ``4 N + 6 N_a`` per token in all instead
of ``6 N`` (attention has no weights: its backward is still two forwards' worth); a
frozen ``from:`` view of its base (``base_of``) is the base alone, and so is its
generation from merged weights (``lora.merge_for_generation``, ``ModelShape.merged``). Rows that repeat a prompt share its
forward (``rlhfflow.engine.forward.shared_prompt_rows``): the prompt's tokens and its
own attention pairs count once, each row's response and its attention to the prompt
per row (``runtime.worker.host.partial_metrics``).

What is not counted: padding, recomputation (gradient checkpointing, a drafter's
rejected tokens), the embedding lookups, norms, activations, softmax and the optimizer
(elementwise, a few FLOPs per weight or activation), evaluation stages, and stages that
do not run every iteration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhfflow.config.shapes import ModelShape

if TYPE_CHECKING:
    from rlhfflow.config.pipeline import Pipeline


@dataclass(frozen=True)
class StageWork:
    """What one stage's useful FLOPs per iteration are made of.

    Attributes:
        stage: the stage's name.
        model: its model's name.
        dtype: the model's compute dtype name (``float32``, ``bfloat16``, ``float16``):
            the peak its FLOPs are measured against.
        passes: forwards per token (``PlanHints.passes``).
        per_token: FLOPs per token of one forward's products with the weights, ``2 N``
            (a LoRA model's adapters included).
        per_pair: FLOPs per (query, key) pair of one forward's attention, ``4 L A``.
        weight_passes: forwards' worth of the products with the weights per token:
            ``passes``, less the weight gradients a LoRA model's frozen base does not
            compute (``weight_passes``); None: ``passes``.
    """

    stage: str
    model: str
    dtype: str
    passes: float
    per_token: float
    per_pair: float
    weight_passes: float | None = None

    def flops(self, tokens: float, pairs: float) -> float:
        """The stage's FLOPs over ``tokens`` real tokens whose causal attention has
        ``pairs`` (query, key) pairs (``attention_pairs``)."""
        weights = self.passes if self.weight_passes is None else self.weight_passes
        return weights * self.per_token * tokens + self.passes * self.per_pair * pairs


def forward_flops(shape: ModelShape, lengths: list[int]) -> float:
    """FLOPs of one forward of a model of ``shape`` over sequences of ``lengths`` real
    tokens (the formula of the module docstring)."""
    return sum(2 * shape.matmul_params * s + 4 * shape.layers * shape.attention_width
               * attention_pairs(s) for s in lengths)


def attention_pairs(length: int) -> int:
    """(query, key) pairs of causal attention over ``length`` tokens: token ``t`` (from
    1) attends to ``t`` keys."""
    return length * (length + 1) // 2


def stage_work(pipeline: Pipeline, shapes: Mapping[str, ModelShape]) -> list[StageWork]:
    """The loop stages whose model work counts: every stage with a model that runs every
    iteration and is no evaluation (an evaluation works on its own prompts), where the
    model's shape is known."""
    spec, graph = pipeline.spec, pipeline.graph
    work = []
    for name in graph.loop_stages:
        node = graph.nodes[name]
        if not node.model:
            continue
        shape = shapes.get(node.model)
        if shape is None or not shape.matmul_params or node.reports or node.every != 1:
            continue
        # a LoRA model generating from merged weights multiplies by the base's shapes only
        adapters = 0 if node.generates and shape.merged else shape.adapters or 0
        work.append(StageWork(
            stage=name, model=node.model, dtype=spec.models[node.model].dtype,
            passes=node.passes, per_token=2.0 * (shape.matmul_params + adapters),
            per_pair=4.0 * shape.layers * shape.attention_width,
            weight_passes=weight_passes(node.passes, shape) if node.trains else None))
    return work


def weight_passes(passes: float, shape: ModelShape) -> float:
    """Forwards' worth of the weight products per token of a training stage that does
    ``passes`` forwards' worth (3 per epoch: forward, input gradients, weight gradients)
    on a model of ``shape``: a LoRA model's ``N`` frozen base weights skip the third,
    its adapters do all three (``4 N + 6 N_a`` per epoch over ``2 (N + N_a)``)."""
    if shape.adapters is None:
        return passes
    frozen = shape.matmul_params
    return passes * (1.0 - frozen / (3.0 * (frozen + shape.adapters)))


def utilisation(flops: Mapping[str, float], work: list[StageWork],
                peaks: Mapping[str, float], seconds: float) -> float | None:
    """MFU: the time the stages' ``flops`` (by stage) take at the matmul peak of each
    stage's dtype (``peaks``, FLOP/s), as a share of ``seconds``; None without a peak
    or a time."""
    if seconds <= 0:
        return None
    at_peak = 0.0
    for w in work:
        peak = peaks.get(w.dtype)
        if not peak:
            return None
        at_peak += flops.get(w.stage, 0.0) / peak
    return at_peak / seconds


def run_utilisation(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The MFU of metrics ``records`` together (each record's time at peak, summed, over
    their wall time), their model FLOP rate and the matmul peaks of the last; nothing
    where the records count no model FLOPs."""
    counted = [r for r in records if r.get("model_flops")]
    if not counted:
        return {}
    seconds = max(sum(r["iteration_s"] for r in counted), 1e-9)
    at_peak = [r["mfu"] * r["iteration_s"] for r in counted if r.get("mfu") is not None]
    return {"model_flops_per_s": round(sum(r["model_flops"] for r in counted) / seconds),
            "mfu": round(sum(at_peak) / seconds, 4) if len(at_peak) == len(counted)
            else None,
            "matmul_peak_flops_per_s": dict(counted[-1].get("matmul_peak_flops_per_s", {}))}
