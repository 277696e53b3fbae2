"""A run that resumes or recovers with a stage that reorders rows (``stream_order:
finish``) reads from the buffer which episodes the iterations before took
(``rlhfflow.runtime.dataflow.taken_before``): those a task may meet again are never
played twice, and a prompt's left-padded prompt columns fit the buffer's wider ones."""

from __future__ import annotations

import numpy as np
import torch

from rlhfflow.runtime.dataflow import taken_before
from rlhfflow.storage.buffer import ColumnSpec, ExperienceBuffer

COLUMNS = ("source_iteration", "prompt_index", "sample_index")


def _iteration(buffer: ExperienceBuffer, k: int, keys: list[tuple[int, int, int]],
               commit: bool = True) -> None:
    buffer.begin_iteration(k, len(keys), {c: ColumnSpec("int64") for c in COLUMNS},
                           chunk_rows=len(keys))
    ExperienceBuffer.write_rows(buffer.path, k, 0, {
        c: torch.tensor([key[i] for key in keys]) for i, c in enumerate(COLUMNS)})
    if commit:
        buffer.commit(k)


def test_the_episodes_taken_before_a_resume_that_a_later_task_may_meet(tmp_path):
    buffer = ExperienceBuffer(tmp_path / "buffer.zarr")
    _iteration(buffer, 0, [(0, 1, 0), (1, 2, 0)])
    _iteration(buffer, 1, [(0, 0, 0), (1, 3, 0)])
    _iteration(buffer, 2, [(1, 2, 1), (2, 5, 0)])
    _iteration(buffer, 3, [(3, 7, 0), (4, 9, 0)], commit=False)  # crashed: not taken
    # resumed at 3 under max_staleness 1: what iterations 1-2 took of iteration 2 or
    # later, and iteration 0's early take of iteration 1's no longer matters
    assert taken_before(buffer, 3, 1) == {(2, 5, 0)}
    # max_staleness 2: iteration 1's rows onward from iterations 0-2
    assert taken_before(buffer, 3, 2) == {(1, 2, 0), (1, 3, 0), (1, 2, 1), (2, 5, 0)}
    assert taken_before(buffer, 0, 1) == frozenset()


def test_narrower_prompts_are_left_padded_into_the_buffer(tmp_path):
    buffer = ExperienceBuffer(tmp_path / "buffer.zarr")
    buffer.begin_iteration(0, 2, {"prompt_ids": ColumnSpec("int64", (5,)),
                                  "prompt_mask": ColumnSpec("bool", (5,))}, chunk_rows=2)
    ids = torch.tensor([[0, 7, 8], [4, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.int8)
    ExperienceBuffer.write_rows(buffer.path, 0, 0, {"prompt_ids": ids, "prompt_mask": mask},
                                left=("prompt_ids", "prompt_mask"))
    buffer.commit(0)
    got = buffer.read(0, ["prompt_ids", "prompt_mask"])
    assert np.array_equal(got["prompt_ids"], [[0, 0, 0, 7, 8], [0, 0, 4, 5, 6]])
    assert np.array_equal(got["prompt_mask"], [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
