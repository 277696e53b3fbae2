"""Prompt data sets named by Hub id (``org/name[@revision]``), read from the local Hugging
Face cache: never downloaded during a run.

The cache is huggingface_hub's (``datasets--org--name/snapshots/COMMIT/...``), which both
``hf download --repo-type dataset`` and ``datasets.load_dataset`` fill. Which files hold a
subset's split follows the Hub's conventions: the ``configs:`` of the dataset card
(``README.md``), else file and folder names (``data/train-00000-of-00001.parquet``,
``main/test.jsonl``, ``train/*.parquet``). The files are read like local ones
(``read_records``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rlhfflow.data.records import DataError, missing_file
from rlhfflow.engine.hub import hub_cache_dir, is_hub_id

#: Files a Hub data set may keep its rows in that ``read_records`` reads.
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class HubDataError(DataError):
    """A Hub data set the cache lacks, or a subset or split it does not have. ``key`` is
    the ``data`` key at fault (``prompts``, ``subset``, ``split``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


def fetch_hint(hub_id: str, subset: str | None) -> str:
    """How to put a Hub data set into the local cache."""
    repo, _, revision = hub_id.partition("@")
    args = ", ".join(repr(a) for a in (repo, subset) if a)
    rev = f" --revision {revision}" if revision else ""
    return (f"fetch it first with `hf download --repo-type dataset {repo}{rev}` or "
            f"`python -c \"import datasets; datasets.load_dataset({args})\"`")


def dataset_snapshot(hub_id: str, subset: str | None = None) -> Path:
    """The cached snapshot directory of data set ``org/name[@revision]``; never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo, _, revision = hub_id.partition("@")
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo, repo_type="dataset", revision=revision or None,
                                      cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        raise HubDataError("prompts", f"{hub_id!r} is not a local file or directory and not in "
                           f"the Hugging Face cache (HF_HUB_CACHE={cache}); "
                           f"{fetch_hint(hub_id, subset)}") from None


def _card_configs(snapshot: Path) -> list[dict[str, Any]]:
    """The ``configs:`` list of the dataset card's YAML header, or []."""
    import yaml

    card = snapshot / "README.md"
    if not card.is_file():
        return []
    text = card.read_text(encoding="utf-8", errors="replace")
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    try:
        header = yaml.safe_load(match.group(1)) if match else None
    except yaml.YAMLError:
        return []
    configs = header.get("configs") if isinstance(header, dict) else None
    return [c for c in configs if isinstance(c, dict)] if isinstance(configs, list) else []


def _choose_config(hub_id: str, configs: list[dict[str, Any]], subset: str | None
                   ) -> dict[str, Any]:
    names = [str(c.get("config_name", "default")) for c in configs]
    if subset is not None:
        if subset not in names:
            raise HubDataError("subset", f"{hub_id!r} has no subset {subset!r} (it has "
                               f"{', '.join(names)})")
        return configs[names.index(subset)]
    chosen = [c for c in configs if c.get("default") is True] or \
        [c for c, n in zip(configs, names, strict=True) if n == "default"]
    if chosen or len(configs) == 1:
        return (chosen or configs)[0]
    raise HubDataError("subset", f"{hub_id!r} has several subsets ({', '.join(names)}): "
                       f"choose one")


def _card_patterns(config: dict[str, Any], split: str) -> list[str] | None:
    """The file patterns of ``split`` in a card config, or None when it has no such split."""
    files = config.get("data_files")
    base = str(config.get("data_dir", "")).strip("/")
    if files is None:
        return None
    if isinstance(files, dict):  # {split: pattern(s)}
        files = [{"split": k, "path": v} for k, v in files.items()]
    if isinstance(files, str):
        files = [files]
    patterns: list[str] = []
    for entry in files:
        if isinstance(entry, str) and split == "train":
            patterns.append(entry)
        elif isinstance(entry, dict) and entry.get("split") == split:
            path = entry.get("path")
            patterns += [path] if isinstance(path, str) else list(path or [])
    return [f"{base}/{p}" if base else p for p in patterns] or None


def _card_splits(config: dict[str, Any]) -> list[str]:
    files = config.get("data_files")
    if isinstance(files, dict):
        return list(files)
    if isinstance(files, list) and any(isinstance(e, dict) for e in files):
        return [str(e.get("split")) for e in files if isinstance(e, dict)]
    return ["train"]


def _named_split_files(root: Path, split: str) -> tuple[list[Path], set[str]]:
    """Data files under ``root`` whose path names ``split`` as a word (``train-0000.parquet``,
    ``data/train.jsonl``, ``train/part.parquet``), and the split names seen."""
    known = {"train", "test", "validation", "valid", "dev", "eval"}
    files = sorted(p for p in root.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    matched, seen = [], set()
    for path in files:
        words = set(re.split(r"[-_./]", str(path.relative_to(root).with_suffix(""))))
        seen |= words & (known | {split})
        if split in words:
            matched.append(path)
    if not matched and split == "train" and not seen:
        return files, seen  # no split names at all: the files are the train split
    return matched, seen


def split_files(hub_id: str, snapshot: Path, subset: str | None, split: str) -> list[Path]:
    """The files holding ``split`` of ``subset`` in a data set's snapshot."""
    configs = _card_configs(snapshot)
    if configs:
        config = _choose_config(hub_id, configs, subset)
        patterns = _card_patterns(config, split)
        if patterns is None:
            raise HubDataError("split", f"{hub_id!r} subset {config.get('config_name', 'default')!r}"
                               f" has no split {split!r} (it has "
                               f"{', '.join(_card_splits(config))})")
        files = sorted({p for pattern in patterns for p in snapshot.glob(pattern)
                        if p.is_file() and p.suffix in DATA_SUFFIXES})
        if not files:
            raise HubDataError("split", f"{hub_id!r}: no cached Parquet or JSONL file matches "
                               f"{', '.join(patterns)} (split {split!r}); "
                               f"{fetch_hint(hub_id, subset)}")
        return files
    root = snapshot
    if subset is not None:
        root = snapshot / subset
        if not root.is_dir():
            have = sorted(p.name for p in snapshot.iterdir()
                          if p.is_dir() and not p.name.startswith("."))
            raise HubDataError("subset", f"{hub_id!r} has no subset {subset!r} (it has "
                               f"{', '.join(have) or 'none'})")
    files, seen = _named_split_files(root, split)
    if not files:
        raise HubDataError("split", f"{hub_id!r} has no cached Parquet or JSONL files of split "
                           f"{split!r}" + (f" (it has {', '.join(sorted(seen))})" if seen
                                           else f"; {fetch_hint(hub_id, subset)}"))
    return files


def locate(prompts: str, base_dir: Path, split: str = "train",
           subset: str | None = None) -> list[Path]:
    """The files (or saved ``datasets`` directory) to read for a ``prompts`` value: a path
    relative to ``base_dir`` when it exists (a local path always wins), else the cached
    files of the Hub data set it names. Raises ``HubDataError`` naming the key at fault."""
    local = Path(prompts).expanduser()
    local = local if local.is_absolute() else (base_dir / local).resolve()
    if local.exists():
        return [local]
    if not is_hub_id(prompts) or local.suffix in (*DATA_SUFFIXES, ".csv"):
        raise HubDataError("prompts", missing_file(local))
    return split_files(prompts, dataset_snapshot(prompts, subset), subset, split)
