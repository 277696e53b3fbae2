"""Reading data sets (JSONL, Parquet, a saved HF ``datasets`` directory) and turning
prompts (plain text or chat turns) into the batch layout stages share."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from rlhfflow.engine.batch import pad_prompts
from rlhfflow.errors import UserError


class DataError(UserError, ValueError):
    """A problem with a data file: names the file, the line and what was expected."""


def missing_file(path: Path) -> str:
    """"file not found: PATH", and the command that makes the file when a script writes
    it: a ``make_data.py`` beside it, or beside its folder (an example's ``data/``), that
    names it."""
    for folder in (path.parent, path.parent.parent):
        script = folder / "make_data.py"
        try:
            writes = path.name in script.read_text(encoding="utf-8")
        except OSError:
            continue
        if writes:
            shown = os.path.relpath(script)
            shown = shown if not shown.startswith("..") else str(script)
            return f"file not found: {path}; make it with `python {shown}`"
    return f"file not found: {path}"


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


#: Roles a ``messages`` turn may have (those chat templates of the HF hub know).
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def read_records(path: str | Path, skipped: list[str] | None = None,
                 line_numbers: list[int] | None = None, split: str = "train"
                 ) -> list[dict[str, Any]]:
    """Records of a data set: a JSONL file, a Parquet file (needs ``pyarrow``) or a
    directory saved with ``datasets.Dataset.save_to_disk`` (needs ``datasets``; of a
    ``DatasetDict``, ``split``). Errors and ``line_numbers`` count lines of a JSONL file
    and rows (from 1) otherwise."""
    path = Path(path)
    if path.is_dir():
        rows = _hf_rows(path, split)
    elif path.suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        return read_jsonl(path, (), skipped, line_numbers)
    if not rows:
        raise DataError(f"{path}: no records")
    if line_numbers is not None:
        line_numbers.extend(range(1, len(rows) + 1))
    return rows


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read Parquet: {str(exc).splitlines()[0]}") from None


def _hf_rows(path: Path, split: str = "train") -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: a directory is read as a saved HF dataset, which needs "
                        f"the datasets package (pip install datasets)") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise DataError(f"{path}: not a dataset saved with save_to_disk: "
                        f"{str(exc).splitlines()[0]}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: a DatasetDict without a {split!r} split "
                            f"(has {', '.join(loaded)})")
        loaded = loaded[split]
    return [dict(row) for row in loaded]


def prompt_problem(record: Any, prompt_field: str = "prompt") -> str | None:
    """What is wrong with a prompt record, or None: it must be an object with a string
    ``prompt_field`` or a ``messages`` list of ``{"role", "content"}`` turns with known
    roles."""
    if not isinstance(record, dict):
        return "expected a JSON object"
    messages = record.get("messages")
    if messages is None:
        if not isinstance(record.get(prompt_field), str):
            return f"expected a string field {prompt_field!r} or a 'messages' list"
        return None
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {\"role\", \"content\"} turns"
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
            return f"messages[{i}]: expected {{\"role\": ..., \"content\": \"text\"}}"
        if turn.get("role") not in CHAT_ROLES:
            return (f"messages[{i}].role: unknown role {turn.get('role')!r} (expected one "
                    f"of {', '.join(CHAT_ROLES)})")
    return None


def render_prompt(tokenizer: Any, record: dict[str, Any], chat_template: bool | str,
                  prompt_field: str = "prompt", tools: list[dict] | None = None
                  ) -> tuple[str, bool]:
    """The text the model is given for a (checked) prompt record, and whether it came
    from the tokenizer's chat template (which then owns every special token).

    ``chat_template``: ``"auto"`` applies the template to ``messages`` records when the
    tokenizer has one; ``True`` applies it to every record (a plain prompt becomes one
    user turn); ``False`` never does. The generation prompt (the assistant's header) is
    appended, so the model answers instead of continuing the user's turn. ``tools``
    (OpenAI function schemas) go to the template's ``tools=``, which shows them where the
    template has a place for them; a prompt not rendered with the template is as written.
    Raises ``ValueError`` when the record needs a template the tokenizer lacks."""
    messages = record.get("messages")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use = chat_template is True or (chat_template == "auto" and messages is not None)
    if not use:
        if messages is not None:
            raise ValueError("a 'messages' record needs a chat template; data.chat_template "
                             "is false")
        return record[prompt_field], False
    if not has_template:
        raise ValueError("the tokenizer has no chat template (chat_template in its "
                         "tokenizer_config.json)" + ("" if chat_template is True else
                                                     " to render 'messages' records"))
    if messages is None:
        messages = [{"role": "user", "content": record[prompt_field]}]
    text = tokenizer.apply_chat_template(messages, tools=tools or None,
                                         add_generation_prompt=True, tokenize=False)
    return text, True


def prompt_token_ids(tokenizer: Any, text: str, templated: bool = False) -> list[int]:
    """Token ids of a prompt. A plain prompt gets the BOS token in front unless it
    already starts with it (the user typed it); a templated one is taken as the
    template wrote it, since templates place their own start tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if not templated and bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def prompt_length(tokenizer: Any, text: str) -> int:
    """Tokens a plain prompt takes in a batch: its own plus the BOS token, if any."""
    return len(prompt_token_ids(tokenizer, text))


def encode_prompts(tokenizer: Any, texts: list[str], max_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(prompt_ids [N, L], prompt_mask [N, L] int8)`` of plain prompts; L is
    the longest prompt. A prompt longer than ``max_tokens`` is an error naming its index."""
    encoded = [prompt_token_ids(tokenizer, t) for t in texts]
    for i, ids in enumerate(encoded):
        if len(ids) > max_tokens:
            raise DataError(f"prompt {i} has {len(ids)} tokens, more than max_prompt_tokens="
                            f"{max_tokens}: {texts[i][:40]!r}")
    return pad_prompts(encoded, tokenizer.pad_token_id)


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
