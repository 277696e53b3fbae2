"""The shapes of a pipeline's models (parameters, layers, width, vocabulary, bytes), read
from their configs without loading weights: what placement balances and sizes its
transfers by, and what the cost model prices work with."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def nbytes(self) -> int:
        return self.params * self.bytes_per_param


def model_shapes(pipeline) -> dict[str, ModelShape]:
    """The shape of every model of ``pipeline`` (from its config, built on the meta
    device; a ``tiny:`` model's from its arguments; a model not on disk yet has an
    unknown, zero shape)."""
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
    shapes = {}
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
        try:
            config = model_config(pipeline.model_dir(root.path))
        except (OSError, ValueError):
            shapes[name] = ModelShape(0, 0, 0, 0)
            continue
        params = parameter_bytes(config, model.head, dtype) // size
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 1)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 1)
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
        width = heads * (getattr(config, "head_dim", None) or hidden // heads)
        shapes[name] = ModelShape(int(params), int(layers), int(hidden),
                                  int(getattr(config, "vocab_size", 1)), size,
                                  matmul_parameters(config, model.head), int(width))
    return shapes
