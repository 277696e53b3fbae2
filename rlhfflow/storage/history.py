"""Earlier responses to the same prompts, read back from the buffer: the history the
generate stage's n-gram drafter looks for repeats in (RL revisits its prompts)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from rlhfflow.storage.buffer import ExperienceBuffer


def prompt_history(
    path: str | os.PathLike,
    prompt_indices: Sequence[int],
    per_prompt: int,
    last_iterations: int,
) -> dict[int, list[list[int]]]:
    """Earlier prompt+response token sequences of each of ``prompt_indices`` in the last
    ``last_iterations`` committed iterations of the buffer at ``path``: at most
    ``per_prompt`` each, oldest first (the generate stage's n-gram drafter looks for
    repeats in them). Padding is dropped. A missing buffer, or iterations lacking the
    token columns, give nothing."""
    columns = ("prompt_index", "prompt_ids", "prompt_mask", "response_ids", "response_mask")
    wanted = {int(p) for p in prompt_indices}
    found: dict[int, list[list[int]]] = {p: [] for p in wanted}
    if not wanted or per_prompt <= 0 or last_iterations <= 0:
        return found
    try:
        buffer = ExperienceBuffer(path, create=False)
    except FileNotFoundError:
        return found
    for iteration in reversed(buffer.iterations()[-last_iterations:]):
        need = {p for p in wanted if len(found[p]) < per_prompt}
        if not need:
            break
        group = buffer.committed_group(iteration)
        if not set(columns) <= set(group.array_keys()):
            continue
        index = group["prompt_index"][:]
        rows = np.flatnonzero(np.isin(index, list(need)))
        if not len(rows):
            continue
        data = {c: group[c].get_orthogonal_selection((rows,)) for c in columns[1:]}
        for j, row in enumerate(rows.tolist()):
            p = int(index[row])
            if len(found[p]) >= per_prompt:
                continue
            seq = data["prompt_ids"][j][data["prompt_mask"][j].astype(bool)].tolist()
            seq += data["response_ids"][j][data["response_mask"][j].astype(bool)].tolist()
            found[p].append(seq)
    return {p: seqs[::-1] for p, seqs in found.items()}
