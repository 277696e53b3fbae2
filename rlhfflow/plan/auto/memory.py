"""What a worker holds while it trains, in bytes: the constants measured for it and the
pure functions of a model's shape that ``CostModel.memory_parts``
(``rlhfflow.plan.auto.costmodel``) adds up per worker (docs/concepts/planner.md)."""

from __future__ import annotations

from rlhfflow.config.shapes import ModelShape

#: Resident bytes of a worker process before it loads a model: Python with torch,
#: transformers, Dask, zarr and the stages imported (measured 405 MiB, 2026-11-28, torch
#: 2.x on CPU). A run's worker is measured against its limit by its whole RSS.
WORKER_PROCESS = 400 * 2**20
#: Bytes a training task holds besides its weights, gradients, optimizer state and
#: activations (autograd's bookkeeping, the process group's buffers, the allocator's
#: slack): measured 20-26 MB on each of the candidates of ``benchmarks/sharded_memory.py``.
TRAIN_OVERHEAD = 20 * 2**20
#: Values of vocabulary width a training step keeps per predicted token (fp32): the
#: logits, their log-softmax and what the loss and its gradient make of them. Fitted to
#: SmolLM2-135M's 49152-token vocabulary (benchmarks/memory_saving.py, 2 rows x 128
#: tokens, the loss over 64 response tokens each: 2670 MiB over the loaded weights
#: measured, 2579 predicted; with checkpointing 2084 and 2074).
LOGITS = 20
#: Values of hidden width a Llama decoder layer keeps per token for its backward (fp32):
#: measured 31 on a forward of 4 rows x 64 tokens, hidden 512, 8 layers
#: (``benchmarks/sharded_memory.py``; the estimate was 16 before, half the measured).
ACTIVATIONS = 32


def layer_params(shape: ModelShape, head: str = "lm") -> tuple[float, float]:
    """(one decoder layer's parameters, the rest: embeddings, an untied head, the
    final norm), from the matrix weights a token passes through."""
    out = shape.hidden * (shape.vocab if head == "lm" else 1)
    layers = max(1, shape.layers)
    per_layer = max(0, shape.matmul_params - out) / layers if shape.matmul_params else \
        shape.params / layers
    return per_layer, max(0.0, shape.params - per_layer * layers)


def trainer_state(shape: ModelShape, gang: int = 1, head: str = "lm", saves: bool = False
                  ) -> dict[str, float]:
    """Peak bytes of a trained model's weights (``weights``) and of its gradients and
    AdamW state (``trained``) on one worker of its home, unsharded (``gang`` 1: the
    whole copy, gradients and two fp32 moments of what trains) or sharded over ``gang``
    workers (``backend: fsdp``, docs/how-to/sharded-training.md): ``4P/N`` of weights
    and ``8P/N`` of moments of what trains (a LoRA model's: of its adapters; the
    gradients are counted with the step's activations, :meth:`CostModel.task_bytes`,
    which they replace as the backward runs); on top, one decoder layer's whole
    weights and gradients while it runs and the embeddings, head and final norm (the
    root, gathered for the whole forward and backward) with theirs (of a LoRA model,
    the weights only: its frozen base has no gradients). ``transient``: what
    a task that is not a training step may hold beyond that, alone on the worker:
    loading reads the whole model (``2 x 4P`` for a moment, measured unsharded and
    before sharding it: what a LoRA model's rank holds at its peak,
    ``benchmarks/sharded_memory.py --lora 8``) and, on
    the rank that saves (``saves``), a checkpoint gathers the whole weights (``4P``
    besides its weights and moments, its gradients freed; a LoRA model's checkpoint
    gathers its adapters, and its final export loads the whole base to merge them)."""
    trained = shape.trained * 4
    if gang <= 1:  # loading: below the state of a full fine-tune, a LoRA model's peak
        steady = shape.nbytes + 3.0 * trained
        return {"weights": float(shape.nbytes), "trained": 3.0 * trained,
                "transient": max(0.0, 2.0 * shape.nbytes - steady)}
    layer, root = layer_params(shape, head)
    weights, moments = shape.nbytes / gang, 2 * trained / gang
    # the gradients: CostModel.task_bytes
    gathered = (1 if shape.adapters is not None else 2) * 4 * (layer + root)
    steady = weights + moments + gathered
    transient = max(2.0 * shape.nbytes, weights + moments + shape.nbytes if saves else 0.0)
    return {"weights": weights, "trained": steady - weights,
            "transient": max(0.0, transient - steady)}


def train_task_bytes(shape: ModelShape, rows: float, tokens: int, gang: int, backend: str,
                     checkpointing: bool, predicted: int | None = None) -> float:
    """Peak bytes of one rank's training step on ``rows`` rows of ``tokens`` tokens
    besides its weights and optimizer state (:func:`trainer_state`): its activations
    (:func:`activation_bytes`), in a data-parallel gang (``backend: torch``) at least the
    gradients' flat all-reduce buffer, sharded (``fsdp``) the gradients' shards, and
    ``TRAIN_OVERHEAD``. ``predicted``: the tokens of a row whose logits the step
    computes (a trainer's: the response's; default all)."""
    act = activation_bytes(shape, rows, tokens, checkpointing, predicted)
    if gang > 1 and backend == "torch":
        # the gradients' all-reduce copies them into one flat buffer, after the backward
        # (engine.parallel.allreduce_gradients)
        act = max(act, shape.trained * 4.0)
    elif gang > 1 and backend == "fsdp":
        # the gradients' shards, freed after each step, grow in the backward as the
        # activations go; checkpointed, a layer's recomputed ones join them
        grads = shape.trained * 4.0 / gang
        act = act + grads if checkpointing else max(act, grads)
    return act + TRAIN_OVERHEAD


def rank_saves(worker: int, home: tuple[int, ...]) -> bool:
    """Whether ``worker`` is the rank of ``home`` that gathers and saves the model."""
    return bool(home) and worker == home[0]


def activation_bytes(shape: ModelShape, rows: float, tokens: int, checkpointing: bool,
                     predicted: int | None = None) -> float:
    """Activations a training step keeps for its backward on ``rows`` rows of ``tokens``
    tokens: ``ACTIVATIONS`` values of hidden width per token and decoder layer, fp32;
    with gradient checkpointing each layer's input only, and one layer's while its
    forward runs again in the backward; and ``LOGITS`` values of vocabulary width per
    token whose logits it computes (``predicted`` of them per row, default all: a
    trainer's head runs on the response tokens only, ``engine.forward.response_logits``)."""
    per_token = shape.hidden * 4
    logits = rows * (tokens if predicted is None else predicted) * shape.vocab * 4 * LOGITS
    if checkpointing:
        return rows * tokens * per_token * (shape.layers + ACTIVATIONS) + logits
    return rows * tokens * per_token * shape.layers * ACTIVATIONS + logits
