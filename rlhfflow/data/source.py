"""Prompts for each iteration: a deterministic walk over shuffled epochs of the file.

Iteration ``k`` takes prompts ``k*B .. k*B+B-1`` of an endless stream made of epochs, each
a permutation of the file seeded by ``(seed, epoch)``; each prompt is repeated
``samples_per_prompt`` times. Prompts are rendered (chat template) and tokenized once, up
front, so a bad file or an over-long prompt stops the run before any cluster work; the
loader does the same for ``rlhfflow validate``.

Every field of a record other than the prompt itself (``answer``, ``tests``, ...) travels
with its rows as the text column ``prompt_fields`` (a JSON object per row), from which the
score stage gives reward functions the fields they ask for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from rlhfflow.data.records import (
    DataError,
    pad_prompts,
    prompt_problem,
    prompt_token_ids,
    read_records,
    render_prompt,
)
from rlhfflow.engine.batch import Batch
from rlhfflow.engine.forward import stage_seed
from rlhfflow.errors import SpecError


def micro_batch_bounds(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` row ranges of equal size (the last may be shorter);
    the size is the zarr chunk, so every micro-batch writes its own chunks."""
    size = -(-rows // max(1, min(micro_batches, rows)))
    return [(a, min(rows, a + size)) for a in range(0, rows, size)]


def load_tokenizer(pipeline, model: str):
    """The tokenizer of ``model`` (of the model its weights come from)."""
    root = pipeline.spec.models[pipeline.model_root(model)]
    if root.tiny is not None:
        from rlhfflow.engine.models import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pipeline.model_dir(root.path)))


class PromptSource:
    """The data stage: builds each iteration's batch of source columns. ``from_pipeline``
    reads and checks the prompts file up front; a plain prompt longer than
    ``max_prompt_tokens`` given to the constructor directly fails in ``batch``.

    ``token_ids`` (one list per prompt, as rendered) defaults to the plain prompts with
    the BOS token; ``fields`` (one dict per prompt) to none."""

    def __init__(self, texts: list[str], tokenizer, batch_size: int, samples_per_prompt: int,
                 max_prompt_tokens: int, seed: int, shuffle: bool = True,
                 token_ids: Sequence[Sequence[int]] | None = None,
                 fields: Sequence[dict] | None = None) -> None:
        self.texts = texts
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.samples = samples_per_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.max_tokens = max_prompt_tokens
        self.token_ids = list(token_ids) if token_ids is not None else None
        self.fields = [dict(f) for f in fields] if fields is not None else [{}] * len(texts)
        # default=str: Parquet and datasets rows may hold dates or bytes, kept as their text
        self._fields_json = [json.dumps(f, ensure_ascii=False, sort_keys=True, default=str)
                             for f in self.fields]
        self._epochs: dict[int, list[int]] = {}
        self.skipped: list[str] = []
        self.lines: list[int] = list(range(1, len(texts) + 1))

    @classmethod
    def from_pipeline(cls, pipeline, model: str) -> PromptSource:
        """The source of ``pipeline``, rendering and tokenizing with ``model``'s tokenizer.
        A bad record is a ``DataError`` naming ``file:line`` (or is skipped and listed,
        with ``data.on_bad_prompt: skip``)."""
        data = pipeline.spec.data
        path = pipeline.prompts_path
        skipped: list[str] | None = [] if data.on_bad_prompt == "skip" else None
        lines: list[int] = []
        records = read_records(path, skipped, lines)
        tokenizer = load_tokenizer(pipeline, model)
        if data.chat_template is True and not getattr(tokenizer, "chat_template", None):
            raise SpecError(pipeline.source, "data.chat_template", f"true, but the tokenizer "
                            f"of model {model!r} has no chat template; set it to auto or "
                            f"false, or give the model a tokenizer with one")
        texts, ids, fields, kept_lines = [], [], [], []
        for line, record in zip(lines, records, strict=True):
            problem = prompt_problem(record, data.prompt_field)
            if problem is None:
                try:
                    text, templated = render_prompt(tokenizer, record, data.chat_template,
                                                    data.prompt_field)
                except ValueError as exc:
                    problem = f"{exc} (model {model!r})"
            if problem is None:
                tokens = prompt_token_ids(tokenizer, text, templated)
                if len(tokens) > data.max_prompt_tokens:
                    problem = (f"the prompt has {len(tokens)} tokens, more than "
                               f"data.max_prompt_tokens={data.max_prompt_tokens}")
            if problem is not None:
                if skipped is None:
                    raise DataError(f"{path}:{line}: {problem}")
                skipped.append(f"{path}:{line}: {problem}")
                continue
            texts.append(text)
            ids.append(tokens)
            fields.append({k: v for k, v in record.items()
                           if k not in (data.prompt_field, "messages")})
            kept_lines.append(line)
        if not texts:
            raise DataError(f"{path}: no usable prompt")
        source = cls(texts, tokenizer, data.batch_size, data.samples_per_prompt,
                     data.max_prompt_tokens, pipeline.spec.seed, data.shuffle, ids, fields)
        source.skipped = skipped or []
        source.lines = kept_lines
        return source

    def missing_field(self, name: str) -> int | None:
        """The line (or row) of the first prompt record without field ``name``, if any."""
        return next((line for line, f in zip(self.lines, self.fields, strict=True)
                     if name not in f), None)

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
        if self.token_ids is None:
            encoded = [prompt_token_ids(self.tokenizer, t) for t in texts]
            too_long = next((i for i, e in enumerate(encoded) if len(e) > self.max_tokens), None)
            if too_long is not None:
                raise DataError(f"prompt {prompt_index[too_long]} has "
                                f"{len(encoded[too_long])} tokens, more than "
                                f"max_prompt_tokens={self.max_tokens}")
        else:
            encoded = [self.token_ids[i] for i in prompt_index]
        ids, mask = pad_prompts(encoded, self.tokenizer.pad_token_id)
        return {"prompt_ids": ids, "prompt_mask": mask,
                "prompt_index": torch.tensor(prompt_index), "sample_index":
                torch.tensor(sample_index), "group_ids": torch.tensor(group_ids),
                "prompt_text": texts,
                "prompt_fields": [self._fields_json[i] for i in prompt_index]}
