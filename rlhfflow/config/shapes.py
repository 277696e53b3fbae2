"""The shapes of a pipeline's models (parameters, layers, width, vocabulary, bytes), read
from their configs without loading weights: what placement balances and sizes its
transfers by, and what the cost model prices work with.

They are read here, in the layer that reads what the user's files name (the model
configs are read for the checks too), so that the plan computes with ``ModelShape``
values and imports no engine module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rlhfflow.config.pipeline import Pipeline
    from rlhfflow.config.spec import LoraSpec


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a model's work depends on."""

    params: int
    layers: int
    hidden: int
    vocab: int
    bytes_per_param: int = 4
    #: the matrix weights a token passes through in a forward (``matmul_parameters``)
    matmul_params: int = 0
    #: query heads x head width, what attention's score and value products scale with
    attention_width: int = 0
    #: parameters a LoRA model trains (adapters, a value head): what moves to shadows and
    #: goes into checkpoints; None: all of ``params``
    adapters: int | None = None
    #: the LoRA model whose resident base this frozen model is (no weights of its own)
    base_of: str | None = None
    #: parameters of the merged weights a LoRA model generates with
    #: (``lora.merge_for_generation``): one more copy of its adapted layers' weights in
    #: each worker that generates with it; 0: none
    merged: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the weights a copy of the model holds (a LoRA model's adapters too)."""
        return self.params * self.bytes_per_param + 4 * (self.adapters or 0)

    @property
    def trained(self) -> int:
        """Parameters that train (gradients, AdamW moments in fp32)."""
        return self.params if self.adapters is None else self.adapters

    @property
    def moved_bytes(self) -> int:
        """Bytes a weight move to a shadow or a checkpoint carries."""
        return self.nbytes if self.adapters is None else 4 * self.adapters


def model_shapes(pipeline: Pipeline) -> dict[str, ModelShape]:
    """The shape of every model of ``pipeline`` (from its config, built on the meta
    device; a ``tiny:`` model's from its arguments; a model not on disk yet has an
    unknown, zero shape), with what LoRA changes (``adapters``, ``base_of``)."""
    return {name: _lora(pipeline, name, shape)
            for name, shape in _plain_shapes(pipeline).items()}


def _lora(pipeline: Pipeline, name: str, shape: ModelShape) -> ModelShape:
    """``shape`` with what LoRA changes: a LoRA model's adapter parameters, a frozen
    model that is a LoRA model's base (``runtime.models.base_of``)."""
    from dataclasses import replace

    lora = pipeline.spec.models[name].lora
    if lora is not None and shape.params:
        config = _root_config(pipeline, name)
        adapters, adapted = _adapter_counts(pipeline, name, lora, config)
        shape = replace(shape, adapters=adapters,
                        merged=adapted if _generates_merged(pipeline, name, lora, config) else 0)
    return replace(shape, base_of=pipeline.lora_base(name))


def _root_config(pipeline: Pipeline, name: str) -> PretrainedConfig:
    """The transformers config model ``name``'s weights come from."""
    from rlhfflow.engine.models import build_char_tokenizer, model_config, tiny_config

    root = pipeline.spec.models[pipeline.model_root(name)]
    if root.tiny is not None:
        t = root.tiny
        return tiny_config(build_char_tokenizer(), arch=t.arch, n_layer=t.layers,
                           hidden=t.hidden, n_head=t.heads, max_positions=t.max_positions)
    assert root.path is not None  # a root model has a path or tiny (ModelSpec._one_source)
    return model_config(pipeline.model_dir(root.path))


def _generates_merged(pipeline: Pipeline, name: str, lora: LoraSpec,
                      config: PretrainedConfig) -> bool:
    """Whether LoRA model ``name`` generates from merged weights: asked to
    (``lora.merge_for_generation``) and run by the lean forward, which merges
    (``engine.lean``: a float32 Llama LM on CPU, not switched off)."""
    import os

    import torch

    from rlhfflow.engine import lean

    spec = pipeline.spec
    model = spec.models[name]
    device = "cpu" if spec.cluster.device == "cpu" or not torch.cuda.is_available() else "cuda"
    return (lora.merge_for_generation and model.head == "lm"
            and device in lean.DEVICES and os.environ.get(lean.ENV, "1") != "0"
            and model.dtype == "float32" and model.attn_implementation in (None, "sdpa")
            and lean.unsupported_config(config) is None)


def _adapter_counts(pipeline: Pipeline, name: str, lora: LoraSpec, config: PretrainedConfig
                    ) -> tuple[int, int]:
    """Parameters LoRA adds to model ``name`` and those of the layers it adapts (its
    model built from ``config`` on the meta device)."""
    from rlhfflow.engine.lora import lora_parameter_counts
    from rlhfflow.errors import SpecError

    model = pipeline.spec.models[name]
    try:
        return lora_parameter_counts(config, lora.model_dump(), model.head)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise SpecError(pipeline.source, f"models.{name}.lora.target_modules",
                        str(exc).split(". ")[0]) from None


def _plain_shapes(pipeline: Pipeline) -> dict[str, ModelShape]:
    """Every model's shape as if no LoRA were configured."""
    from rlhfflow.engine.models import (
        build_char_tokenizer,
        matmul_parameters,
        model_config,
        parameter_bytes,
        tiny_matmul_parameters,
        tiny_parameter_count,
    )
    from rlhfflow.engine.resident import DTYPES

    spec = pipeline.spec
    shapes: dict[str, ModelShape] = {}
    for name, model in spec.models.items():
        root = spec.models[pipeline.model_root(name)]
        dtype = DTYPES[model.dtype]
        size = dtype.itemsize
        if root.tiny is not None:  # counted without transformers' model classes
            t = root.tiny
            tokenizer = build_char_tokenizer()
            params = tiny_parameter_count(tokenizer, model.head, arch=t.arch,
                                          n_layer=t.layers, hidden=t.hidden,
                                          max_positions=t.max_positions)
            matmul = tiny_matmul_parameters(tokenizer, model.head, arch=t.arch,
                                            n_layer=t.layers, hidden=t.hidden)
            shapes[name] = ModelShape(params, t.layers, t.hidden, len(tokenizer), size,
                                      matmul, t.hidden)
            continue
        assert root.path is not None  # a root model has a path or tiny
        try:
            config = model_config(pipeline.model_dir(root.path))
        except (OSError, ValueError):
            shapes[name] = ModelShape(0, 0, 0, 0)
            continue
        params = parameter_bytes(config, model.head, dtype) // size
        # transformers' configs spell these two ways; unset (0 or None): the other spelling
        layers: int = getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 1)
        hidden: int = getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 1)
        heads: int = getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 1)
        width = heads * (getattr(config, "head_dim", 0) or hidden // heads)
        shapes[name] = ModelShape(int(params), int(layers), int(hidden),
                                  int(getattr(config, "vocab_size", 1)), size,
                                  matmul_parameters(config, model.head), int(width))
    return shapes
