"""Prompts for each iteration: a deterministic walk over shuffled epochs of the file.

Iteration ``k`` takes prompts ``k*B .. k*B+B-1`` of an endless stream made of epochs, each
a permutation of the file seeded by ``(seed, epoch)``; each prompt is repeated
``samples_per_prompt`` times. Prompts are rendered (chat template) and tokenized once, up
front, so a bad file or an over-long prompt stops the run before any cluster work; the
loader does the same for ``rlhfflow validate``, and a run in the same process takes what
the loader read (``Pipeline.prompts``) instead of reading it again.

Every field of a record other than the prompt itself (``answer``, ``tests``, ...) travels
with its rows as the text column ``prompt_fields`` (a JSON object per row), from which the
score stage gives reward functions the fields they ask for; a chat record's ``messages``
travel there too (the prompts of TRL-style reward functions, the report's sample prompts).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhfflow.data.hub import HubDataError, locate
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


def load_tokenizer(pipeline, model: str):
    """The tokenizer of ``model`` (of the model its weights come from)."""
    root = pipeline.spec.models[pipeline.model_root(model)]
    if root.tiny is not None:
        from rlhfflow.engine.models import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(pipeline.model_dir(root.path)))


KEEP_EPOCHS = 2
"""Shuffled epochs a prompt source keeps per source (made again when asked again)."""
KEEP_PICKS = 4
"""Batches of mixed-source stream positions a prompt source keeps (replayed when asked
again): a long run's memory stays flat."""


class PromptSource:
    """The data stage: builds each iteration's batch of source columns. ``from_pipeline``
    reads and checks the prompts file up front; a plain prompt longer than
    ``max_prompt_tokens`` given to the constructor directly fails in ``batch``.

    ``token_ids`` (one list per prompt, as rendered) defaults to the plain prompts with
    the BOS token; ``fields`` (one dict per prompt) to none."""

    def __init__(self, texts: list[str], tokenizer, batch_size: int, samples_per_prompt: int,
                 max_prompt_tokens: int, seed: int, shuffle: bool = True,
                 token_ids: Sequence[Sequence[int]] | None = None,
                 fields: Sequence[dict] | None = None, groups: Sequence[int] | None = None,
                 weights: Sequence[float] | None = None) -> None:
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
        self._epochs: dict[tuple[int, int], list[int]] = {}
        self.skipped: list[str] = []
        self.locations: list[str] = [f"prompt {i}" for i in range(len(texts))]
        # mixed sources: the prompts of each, and which source each stream position takes
        groups = list(groups) if groups is not None else [0] * len(texts)
        self.members = [[i for i, g in enumerate(groups) if g == s]
                        for s in range(max(groups, default=0) + 1)]
        self.weights = list(weights) if weights is not None else None
        # the stream's positions from _picks_start on -> (source, its count so far)
        self._picks: list[tuple[int, int]] = []
        self._picks_start = 0
        self._taken = [0] * len(self.members)
        #: what ``from_pipeline`` read this source from (None: built directly)
        self.inputs: tuple[object, ...] | None = None

    @classmethod
    def from_pipeline(cls, pipeline, model: str, kept: PromptSource | None = None
                      ) -> PromptSource:
        """The source of ``pipeline``, rendering and tokenizing with ``model``'s tokenizer
        (with the tools ``pipeline.prompt_tools`` gives, for the chat template's ``tools=``).
        A bad record is a ``DataError`` naming ``file:line`` (or is skipped and listed,
        with ``data.on_bad_prompt: skip``); a Hub data set the cache lacks, or records
        without the prompt field, a ``SpecError`` naming the ``data`` key.

        ``kept``: a source read before (``Pipeline.prompts``, the one validation read),
        returned as it is when it was read from the same inputs (``_inputs``), so a run
        does not read and tokenize the prompts a second time."""
        inputs = _inputs(pipeline, model)
        if kept is not None and inputs is not None and kept.inputs == inputs:
            return kept
        data = pipeline.spec.data
        skipped: list[str] | None = [] if data.on_bad_prompt == "skip" else None
        refs = source_refs(data)
        read = [read_source(pipeline, ref, skipped) for ref in refs]
        _check_renames(pipeline, refs, read)
        tokenizer = load_tokenizer(pipeline, model)
        if data.chat_template is True and not getattr(tokenizer, "chat_template", None):
            raise SpecError(pipeline.source, "data.chat_template", f"true, but the tokenizer "
                            f"of model {model!r} has no chat template; set it to auto or "
                            f"false, or give the model a tokenizer with one")
        # the generating stage's tools, shown where the chat template shows tools
        tools = pipeline.prompt_tools(tokenizer)
        texts, ids, fields, locations, groups = [], [], [], [], []
        for group, (ref, records) in enumerate(zip(refs, read, strict=True)):
            _check_prompt_field(pipeline, ref, records)
            kept = len(texts)
            for where, record in records:
                problem = prompt_problem(record, data.prompt_field)
                if problem is None:
                    try:
                        text, templated = render_prompt(tokenizer, record, data.chat_template,
                                                        data.prompt_field, tools)
                    except ValueError as exc:
                        problem = f"{exc} (model {model!r})"
                if problem is None:
                    tokens = prompt_token_ids(tokenizer, text, templated)
                    if len(tokens) > data.max_prompt_tokens:
                        problem = (f"the prompt has {len(tokens)} tokens, more than "
                                   f"data.max_prompt_tokens={data.max_prompt_tokens}")
                if problem is not None:
                    if skipped is None:
                        raise DataError(f"{where}: {problem}")
                    skipped.append(f"{where}: {problem}")
                    continue
                texts.append(text)
                ids.append(tokens)
                # a chat record keeps its messages: TRL-style reward functions take them
                fields.append({k: v for k, v in record.items() if k != data.prompt_field})
                locations.append(where)
                groups.append(group)
            if len(texts) == kept:
                raise DataError(f"{ref.prompts}: no usable prompt")
        weights = [ref.weight for ref in refs] if len(refs) > 1 else None
        source = cls(texts, tokenizer, data.batch_size, data.samples_per_prompt,
                     data.max_prompt_tokens, pipeline.spec.seed, data.shuffle, ids, fields,
                     groups=groups, weights=weights)
        source.skipped = skipped or []
        source.locations = locations
        source.inputs = inputs
        return source

    def missing_field(self, name: str) -> str | None:
        """Where (``file:line``) the first prompt record without field ``name`` is, if any."""
        return next((where for where, f in zip(self.locations, self.fields, strict=True)
                     if name not in f), None)

    def _epoch(self, source: int, epoch: int) -> list[int]:
        """A permutation of ``source``'s prompts, seeded by ``(seed, epoch)`` (and the
        source, when there are several). The last ``KEEP_EPOCHS`` are kept: a run reads
        its epochs in order, and one it asks for again is made again, the same."""
        found = self._epochs.get((source, epoch))
        if found is None:
            n = len(self.members[source])
            if self.shuffle:
                key = "data" if self.weights is None else f"data{source}"
                gen = torch.Generator().manual_seed(stage_seed(self.seed, key, epoch))
                found = torch.randperm(n, generator=gen).tolist()
            else:
                found = list(range(n))
            own = [key for key in self._epochs if key[0] == source]  # oldest made first
            for key in own[:len(own) - KEEP_EPOCHS + 1]:
                del self._epochs[key]
            self._epochs[source, epoch] = found
        return found

    def _pick(self, position: int) -> tuple[int, int]:
        """``(source, count)`` of a stream position: smooth weighted round-robin, each
        position going to the source furthest behind its share (ties: the first), so
        every stretch of the stream mixes the sources in proportion to their weights.
        The last ``KEEP_PICKS`` batches of positions are kept; an earlier position (a
        resumed run reading back) replays the stream from its start."""
        if position < self._picks_start:
            self._picks, self._picks_start = [], 0
            self._taken = [0] * len(self.members)
        total = sum(self.weights)
        while self._picks_start + len(self._picks) <= position:
            p = self._picks_start + len(self._picks)
            behind = [(p + 1) * w / total - t
                      for w, t in zip(self.weights, self._taken, strict=True)]
            source = max(range(len(behind)), key=lambda s: (behind[s], -s))
            self._picks.append((source, self._taken[source]))
            self._taken[source] += 1
        found = self._picks[position - self._picks_start]
        extra = len(self._picks) - KEEP_PICKS * self.batch_size
        if extra > 0:
            del self._picks[:extra]
            self._picks_start += extra
        return found

    def prompt_indices(self, iteration: int) -> list[int]:
        """Indices (into the prompts) of the prompts of ``iteration``."""
        positions = range(iteration * self.batch_size, (iteration + 1) * self.batch_size)
        picks = [(0, p) for p in positions] if self.weights is None else \
            [self._pick(p) for p in positions]
        out = []
        for source, count in picks:
            members = self.members[source]
            out.append(members[self._epoch(source, count // len(members))[count % len(members)]])
        return out

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


@dataclass(frozen=True)
class SourceRef:
    """One prompt source of ``data``: ``data.prompts``, or an entry of ``data.sources``
    with ``data``'s defaults filled in. ``key``: where its keys are in the file."""

    key: str
    prompts: str
    weight: float
    split: str
    subset: str | None
    rename: dict[str, str]
    own: tuple[str, ...] = ()  # the keys a data.sources entry sets itself


def _inputs(pipeline, model: str) -> tuple[object, ...] | None:
    """Everything ``PromptSource.from_pipeline`` reads: the pipeline file (relative paths),
    the tokenizing model, the ``data`` section but for ``micro_batches`` (how a batch
    splits, not what is in it: the planner derives pipelines that change it), the seed,
    the models (tokenizers), the first generator's stage (its tools), and the size and
    time of each prompt file. None if a file cannot be found or read (reading says why)."""
    data = pipeline.spec.data
    generates = pipeline.graph.generators()
    generator = [(pipeline.spec.stages[g], pipeline.params[g]) for g in generates[:1]]
    try:
        paths = [path for ref in source_refs(data)
                 for path in locate(ref.prompts, pipeline.base_dir, ref.split, ref.subset)]
        stamps = [(str(path), path.stat().st_mtime_ns, path.stat().st_size) for path in paths]
    except (HubDataError, OSError):
        return None
    return (pipeline.source, model, data.model_dump(exclude={"micro_batches"}),
            pipeline.spec.seed, pipeline.spec.models, generator, stamps)


def source_refs(data) -> list[SourceRef]:
    """The prompt sources a ``data`` section names, in order."""
    if data.sources is None:
        return [SourceRef("data", data.prompts, 1.0, data.split, data.subset, dict(data.rename))]
    return [SourceRef(f"data.sources[{i}]", s.prompts, s.weight, s.split or data.split,
                      s.subset if s.subset is not None else data.subset,
                      {**data.rename, **s.rename},
                      tuple(k for k in ("split", "subset") if getattr(s, k) is not None))
            for i, s in enumerate(data.sources)]


def read_source(pipeline, ref: SourceRef, skipped: list[str] | None
                ) -> list[tuple[str, dict]]:
    """``(file:line, record)`` of one source, fields renamed (``rename``, then the chat
    field to ``messages``). A Hub data set the cache lacks is a ``SpecError`` naming the
    key (``data.prompts``, ``data.subset``, ...) and how to fetch it."""
    try:
        paths = locate(ref.prompts, pipeline.base_dir, ref.split, ref.subset)
    except HubDataError as exc:
        where = ref.key if exc.key == "prompts" or exc.key in ref.own else "data"
        raise SpecError(pipeline.source, f"{where}.{exc.key}", str(exc)) from None
    renames = dict(ref.rename)
    chat = pipeline.spec.data.messages_field
    if chat != "messages":
        renames.setdefault(chat, "messages")
    out = []
    for path in paths:
        lines: list[int] = []
        records = read_records(path, skipped, lines, split=ref.split)
        out += [(f"{path}:{line}", _renamed(record, renames))
                for line, record in zip(lines, records, strict=True)]
    return out


def _renamed(record, renames: dict[str, str]):
    if not renames or not isinstance(record, dict):
        return record
    return {renames.get(k, k): v for k, v in record.items()}


#: Fields that usually hold the prompt in public data sets, in the order to suggest them.
OBVIOUS_PROMPT_FIELDS = ("question", "instruction", "input", "problem", "query", "text")


def _check_prompt_field(pipeline, ref: SourceRef, records: list[tuple[str, dict]]) -> None:
    """No record with the prompt field nor a chat: the field is misnamed; say which one
    to name when a record has an obvious one."""
    data = pipeline.spec.data
    dicts = [r for _, r in records if isinstance(r, dict)]
    if not dicts or any(data.prompt_field in r or "messages" in r for r in dicts):
        return
    have = list(dicts[0])
    obvious = next((f for f in OBVIOUS_PROMPT_FIELDS if f in have), None)
    whose = "records" if ref.key == "data" else f"records of {ref.key} ({ref.prompts})"
    if obvious is None:
        fix = "set data.prompt_field (or rename a field to it with data.rename)"
    elif ref.key == "data":
        fix = f"set data.prompt_field: {obvious}"
    else:
        fix = f"set {ref.key}.rename: {{{obvious}: {data.prompt_field}}}"
    raise SpecError(pipeline.source, "data.prompt_field", f"{whose} have no "
                    f"{data.prompt_field!r}; they have {', '.join(map(repr, have))}: {fix}")


def _check_renames(pipeline, refs: list[SourceRef], read: list[list[tuple[str, dict]]]) -> None:
    """A rename of a field no record has is a typo."""
    data = pipeline.spec.data
    checks = [("data.rename", data.rename, [r for records in read for r in records])]
    if data.sources is not None:
        checks += [(f"{ref.key}.rename", s.rename, records)
                   for ref, s, records in zip(refs, data.sources, read, strict=True)]
    for key, rename, records in checks:
        for old, new in rename.items():
            if not any(isinstance(r, dict) and new in r for _, r in records):
                have = next((list(r) for _, r in records if isinstance(r, dict)), [])
                close = difflib.get_close_matches(old, have, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else \
                    f" (they have {', '.join(map(repr, have))})"
                raise SpecError(pipeline.source, f"{key}.{old}", f"no record has a field "
                                f"{old!r}{hint}")
