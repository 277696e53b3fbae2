"""Which matmul kernel a CPU product without gradients takes: MKL's GEMM (``F.linear``,
torch's default) or oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``, the
one torch's compiler uses on CPU), chosen per kind of product (an output head's or a
layer's) by timing both once on the machine at hand, and cached beside the matmul peak
(``rlhfflow.engine.machine``). The lean forward's sampling and LoRA training steps take
their products through ``onednn_linear`` (``rlhfflow.engine.lean``, whose docstring has
the measurements).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

#: Environment switch: "0" keeps MKL's products where the model samples (``sampling``),
#: "1" takes oneDNN's for every kind of product; unset, each kind takes the kernel
#: measured faster on this machine (``kernel_timings``).
ONEDNN_ENV = "RLHFFLOW_ONEDNN"
#: Output features from which a product is an output head's (a vocabulary; the largest
#: layer products of common models, 14336 wide, stay below): MKL and oneDNN rank
#: differently on it than on a layer's products.
HEAD_FEATURES = 16384
#: The products timed to choose a kernel, (rows, input features, output features): a
#: 32-row decode step's layer product and output head, SmolLM2-135M's MLP and vocabulary.
KERNEL_SHAPES = {"layer": (32, 576, 1536), "head": (32, 576, 49152)}
#: oneDNN's kernel is taken where its best time is below this fraction of MKL's: a tie
#: (within the timings' noise) keeps MKL's, the default of torch.
ONEDNN_MARGIN = 0.95
#: The cache file (``rlhfflow.engine.machine``) of the kernels' timings.
KERNEL_CACHE = "cpu_kernels.json"
#: Products with fewer output features keep MKL's kernel: at SmolLM2's 192-wide key
#: and value projections oneDNN's was not faster (0.6-1.0x, 32 rows).
ONEDNN_MIN_FEATURES = 512


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no gradients) through oneDNN's kernel, where torch has it,
    ``RLHFFLOW_ONEDNN`` is not 0, ``weight`` has ``ONEDNN_MIN_FEATURES`` rows (output
    features) at least and oneDNN's is the kernel for its kind of product
    (``_kernels``); else MKL's."""
    op = _onednn()
    if (op is None or weight.shape[0] < ONEDNN_MIN_FEATURES or x.dtype != torch.float32
            or x.device.type != "cpu" or not _kernels()[product_kind(weight.shape[0])]):
        return F.linear(x, weight)
    return op(x, weight, None, "none", [], "")


def product_kind(features: int) -> str:
    """The kind of a product with ``features`` output features: ``head`` or ``layer``."""
    return "head" if features >= HEAD_FEATURES else "layer"


def choose_kernels(timings: Mapping[str, Sequence[float]]) -> dict[str, bool]:
    """Whether each kind of product takes oneDNN's kernel, from the best times
    ``(mkl_s, onednn_s)`` of each: where oneDNN's is faster by ``ONEDNN_MARGIN``."""
    return {kind: onednn_s < ONEDNN_MARGIN * mkl_s
            for kind, (mkl_s, onednn_s) in timings.items()}


@functools.cache
def _kernels() -> dict[str, bool]:
    """Whether each kind of product takes oneDNN's kernel in this process: all with
    ``RLHFFLOW_ONEDNN=1``, else as this machine's timings at this process's torch
    thread count choose (``kernel_timings``; measured on the first use, then cached)."""
    if os.environ.get(ONEDNN_ENV) == "1":
        return dict.fromkeys(KERNEL_SHAPES, True)
    return choose_kernels(kernel_timings(torch.get_num_threads(), KERNEL_SHAPES))


def kernel_timings(threads: int, shapes: Mapping[str, tuple[int, int, int]] = KERNEL_SHAPES
                   ) -> dict[str, list[float]]:
    """MKL's and oneDNN's best times of each product of ``shapes`` with ``threads`` torch
    threads, ``{kind: [mkl_s, onednn_s]}``: from the cache (``KERNEL_CACHE``, one entry
    per machine, thread count and torch version, as the matmul peak), or measured now
    (a few tenths of a second, once) and cached."""
    from rlhfflow.engine.machine import cache_path, machine_key, read_cache, write_cache

    path = cache_path(KERNEL_CACHE)
    cached = read_cache(path)
    key = machine_key("F.linear vs mkldnn._linear_pointwise", threads)
    entry = cached.get(key)
    if not (isinstance(entry, dict) and set(entry) >= set(shapes) and all(
            isinstance(entry[k], list) and len(entry[k]) == 2 for k in shapes)):
        entry = measure_kernels(shapes, threads)
        cached[key] = entry
        write_cache(path, cached)
    return {kind: [float(t) for t in entry[kind]] for kind in shapes}


def measure_kernels(shapes: Mapping[str, tuple[int, int, int]], threads: int = 1,
                    rounds: int = 2, seconds: float = 0.05) -> dict[str, list[float]]:
    """Time ``F.linear`` (MKL) and oneDNN's kernel on a product of each shape (rows,
    input features, output features) with ``threads`` torch threads: after one warm-up
    each, products each in turn, ``rounds`` at least and for ``seconds`` (at most 100
    rounds); each kernel's best time (on a shared machine the others' work only ever
    slows a product down, and a layer's 0.5 ms product is timed a hundred times). An
    output head's product is bound by reading its weight (113 MB at SmolLM2's): ~0.15 s
    in all on one core."""
    op = torch.ops.mkldnn._linear_pointwise
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for kind, (rows, inputs, features) in shapes.items():
            # constant operands: the values do not change the time, and a random
            # 49152 x 576 weight takes longer to draw than the products take to time
            x = torch.full((rows, inputs), 0.01)
            w = torch.full((features, inputs), 0.02)
            best, spent, round_ = [float("inf")] * 2, 0.0, 0
            while round_ <= rounds or (spent < seconds and round_ <= 100):
                for onednn in (False, True):
                    start = time.perf_counter()
                    if onednn:
                        op(x, w, None, "none", [], "")
                    else:
                        F.linear(x, w)
                    taken = time.perf_counter() - start
                    if round_:  # the first round warms up
                        best[onednn] = min(best[onednn], taken)
                        spent += taken
                round_ += 1
            out[kind] = best
        return out
    finally:
        torch.set_num_threads(previous)


@functools.cache
def _onednn():
    """oneDNN's linear op, when this torch build has it, it gives ``F.linear``'s values
    (checked once on a small product, with a weight and with a transposed view of one) and
    ``RLHFFLOW_ONEDNN`` is not 0; else None."""
    if os.environ.get(ONEDNN_ENV, "1") == "0" or not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x = torch.linspace(-1, 1, 3 * 40).reshape(3, 40)
        w = torch.linspace(-2, 2, 40 * 24).reshape(24, 40)
        g = torch.linspace(-3, 1, 3 * 24).reshape(3, 24)
        # a contiguous weight (forward passes) and a transposed view (backward passes)
        if not (torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), atol=1e-4)
                and torch.allclose(op(g, w.t(), None, "none", [], ""), g @ w, atol=1e-4)):
            return None
    except (AttributeError, RuntimeError):
        return None
    return op


class FrozenLinear(torch.autograd.Function):
    """``x W^T`` for a weight that does not train, forward and backward (``dx = dy W``)
    through oneDNN's kernel (``onednn_linear``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return onednn_linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        [weight] = ctx.saved_tensors
        return onednn_linear(grad, weight.t()) if ctx.needs_input_grad[0] else None, None
