"""The batch every stage and engine passes around: named columns, one row per sample.

Stages read and write these columns (``rlhfflow.stages.base.Stage``); the runtime splits
a batch into micro-batches and joins them back with the functions here.
"""

from __future__ import annotations

from typing import Any

import torch

Batch = dict[str, Any]
"""Columns of a (micro-)batch: tensors with the row dimension first, or lists of str."""


def concat_batches(parts: list[Batch]) -> Batch:
    """Join micro-batches row-wise; tensors of different trailing lengths are right-padded."""
    if len(parts) == 1:
        return dict(parts[0])
    out: Batch = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if isinstance(values[0], torch.Tensor):
            out[key] = _cat_padded(values)
        else:
            out[key] = [v for part in values for v in part]
    return out


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dim() < 2 or len({t.shape[1:] for t in tensors}) == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
    return torch.cat(padded)


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``[start, stop)`` of every column."""
    return {k: v[start:stop] for k, v in batch.items()}
