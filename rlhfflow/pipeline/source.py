"""Prompts for each iteration: a deterministic walk over shuffled epochs of the file.

Iteration ``k`` takes prompts ``k*B .. k*B+B-1`` of an endless stream made of epochs, each
a permutation of the file seeded by ``(seed, epoch)``; each prompt is repeated
``samples_per_prompt`` times. Prompts are tokenized once, up front, so a bad file or an
over-long prompt stops the run before any cluster work.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from rlhfflow.stages import Batch
from rlhfflow.stages.common import stage_seed
from rlhfflow.stages.data import DataError, encode_prompts, prompt_length, read_jsonl


def micro_batch_bounds(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` row ranges of equal size (the last may be shorter);
    the size is the zarr chunk, so every micro-batch writes its own chunks."""
    size = -(-rows // max(1, min(micro_batches, rows)))
    return [(a, min(rows, a + size)) for a in range(0, rows, size)]


class PromptSource:
    """The data stage: builds each iteration's batch of source columns. ``from_pipeline``
    reads and checks the prompts file up front; a prompt longer than
    ``max_prompt_tokens`` given to the constructor directly fails in ``batch``."""

    def __init__(self, texts: list[str], tokenizer, batch_size: int, samples_per_prompt: int,
                 max_prompt_tokens: int, seed: int, shuffle: bool = True) -> None:
        self.texts = texts
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.samples = samples_per_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.max_tokens = max_prompt_tokens
        self._epochs: dict[int, list[int]] = {}
        self.skipped: list[str] = []

    @classmethod
    def from_pipeline(cls, pipeline, model: str) -> PromptSource:
        """The source of ``pipeline``, tokenizing with ``model``'s tokenizer."""
        data = pipeline.spec.data
        skipped: list[str] | None = [] if data.on_bad_prompt == "skip" else None
        lines: list[int] = []
        records = read_jsonl(pipeline.prompts_path, (data.prompt_field,), skipped, lines)
        root = pipeline.spec.models[pipeline.model_root(model)]
        if root.tiny is not None:
            from rlhfflow.stages.models import build_char_tokenizer

            tokenizer = build_char_tokenizer()
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(pipeline.resolve(root.path)))
        texts = []
        for line, record in zip(lines, records, strict=True):
            text = record[data.prompt_field]
            tokens = prompt_length(tokenizer, text)
            if tokens <= data.max_prompt_tokens:
                texts.append(text)
                continue
            problem = (f"{pipeline.prompts_path}:{line}: the prompt has {tokens} tokens, more "
                       f"than data.max_prompt_tokens={data.max_prompt_tokens}")
            if skipped is None:
                raise DataError(problem)
            skipped.append(problem)
        if not texts:
            raise DataError(f"{pipeline.prompts_path}: no usable prompt")
        source = cls(texts, tokenizer, data.batch_size, data.samples_per_prompt,
                     data.max_prompt_tokens, pipeline.spec.seed, data.shuffle)
        source.skipped = skipped or []
        return source

    def _epoch(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            if self.shuffle:
                gen = torch.Generator().manual_seed(stage_seed(self.seed, "data", epoch))
                self._epochs[epoch] = torch.randperm(len(self.texts), generator=gen).tolist()
            else:
                self._epochs[epoch] = list(range(len(self.texts)))
        return self._epochs[epoch]

    def prompt_indices(self, iteration: int) -> list[int]:
        """Indices (into the file) of the prompts of ``iteration``."""
        n = len(self.texts)
        positions = range(iteration * self.batch_size, (iteration + 1) * self.batch_size)
        return [self._epoch(p // n)[p % n] for p in positions]

    def batch(self, iteration: int) -> Batch:
        """Source columns of ``iteration``: one row per (prompt, sample)."""
        indices = self.prompt_indices(iteration)
        seen: dict[int, int] = {}
        prompt_index, sample_index, group_ids = [], [], []
        for position, idx in enumerate(indices):
            occurrence = seen.get(idx, 0)  # the same prompt twice in a batch: new samples
            seen[idx] = occurrence + 1
            for s in range(self.samples):
                prompt_index.append(idx)
                sample_index.append(occurrence * self.samples + s)
                group_ids.append(iteration * self.batch_size + position)
        texts = [self.texts[i] for i in prompt_index]
        ids, mask = encode_prompts(self.tokenizer, texts, self.max_tokens)
        return {"prompt_ids": ids, "prompt_mask": mask,
                "prompt_index": torch.tensor(prompt_index), "sample_index":
                torch.tensor(sample_index), "group_ids": torch.tensor(group_ids),
                "prompt_text": texts}
