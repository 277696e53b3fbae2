"""The batch every stage and engine passes around: named columns, one row per sample.

Stages read and write these columns (``rlhfflow.sdk.Stage``); the runtime splits
a batch into micro-batches and joins them back with the functions here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhfflow.types import Batch


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


def score_valid(batch: Batch) -> torch.Tensor:
    """``[N]`` bool: samples with a usable score. A batch built by hand, without the
    ``score_valid`` column the score stage writes, has all samples valid."""
    if "score_valid" in batch:
        return batch["score_valid"].bool()
    return torch.ones(len(batch["response_mask"]), dtype=torch.bool)


def pad_prompts(encoded: Sequence[Sequence[int]], pad_id: int | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(prompt_ids [N, L], prompt_mask [N, L] int8)``; L is the longest."""
    width = max(len(ids) for ids in encoded)
    ids = torch.full((len(encoded), width), pad_id if pad_id is not None else 0,
                     dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.int8)
    for row, seq in enumerate(encoded):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(list(seq))
            mask[row, width - len(seq):] = 1
    return ids, mask
