"""Reading JSONL data sets and turning text into the batch layout stages share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class DataError(ValueError):
    """A problem with a data file: names the file, the line and what was expected."""


def read_jsonl(path: str | Path, fields: tuple[str, ...], skipped: list[str] | None = None,
               line_numbers: list[int] | None = None) -> list[dict[str, Any]]:
    """Records of a JSONL file, each a JSON object with string ``fields``; blank lines are
    skipped. A malformed line is a ``DataError`` naming ``path:line`` or, when a
    ``skipped`` list is given, is left out and described there. ``line_numbers``, if
    given, receives the line of each record returned."""
    path = Path(path)
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        problem = None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = f"invalid JSON: {exc.msg}"
        else:
            if not isinstance(record, dict):
                problem = "expected a JSON object"
            else:
                missing = [f for f in fields if not isinstance(record.get(f), str)]
                if missing:
                    problem = f"expected a string field {missing[0]!r}"
        if problem is None:
            records.append(record)
            if line_numbers is not None:
                line_numbers.append(number)
        elif skipped is None:
            raise DataError(f"{path}:{number}: {problem}")
        else:
            skipped.append(f"{path}:{number}: {problem}")
    if not records:
        raise DataError(f"{path}: no records")
    return records


def prompt_length(tokenizer: Any, text: str) -> int:
    """Tokens a prompt takes in a batch: its own plus the BOS token, if there is one."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + (
        tokenizer.bos_token_id is not None)


def encode_prompts(tokenizer: Any, texts: list[str], max_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(prompt_ids [N, L], prompt_mask [N, L] int8)``; L is the longest
    prompt. A prompt longer than ``max_tokens`` is an error naming its index."""
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    bos = tokenizer.bos_token_id
    if bos is not None:
        encoded = [[bos] + ids for ids in encoded]
    for i, ids in enumerate(encoded):
        if len(ids) > max_tokens:
            raise DataError(f"prompt {i} has {len(ids)} tokens, more than max_prompt_tokens="
                            f"{max_tokens}: {texts[i][:40]!r}")
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(texts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.int8)
    for row, seq in enumerate(encoded):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq)
            mask[row, width - len(seq):] = 1
    return ids, mask


def encode_responses(tokenizer: Any, texts: list[str], max_tokens: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(response_ids, response_mask)`` with EOS appended, cut at
    ``max_tokens`` (a response that is cut loses its EOS, as in generation)."""
    eos = tokenizer.eos_token_id
    encoded = []
    for t in texts:
        seq = tokenizer(t, add_special_tokens=False)["input_ids"]
        encoded.append((seq + ([eos] if eos is not None else []))[:max_tokens])
    width = max(1, max(len(s) for s in encoded))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(texts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.int8)
    for row, seq in enumerate(encoded):
        if seq:
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
    return ids, mask
