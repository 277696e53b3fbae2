"""Models named by Hub id (``org/name[@revision]``) in a pipeline's ``path:``, found in the
local Hugging Face cache: never downloaded during a run."""

from __future__ import annotations

import os
import re
from pathlib import Path

from rlhfflow.errors import UserError

# "org/name" or "org/name@revision", as the Hub spells repository ids: no "..", no "--".
_HUB_ID = re.compile(r"^(?!.*(?:\.\.|--))[A-Za-z0-9][\w.-]*/[\w.-]+(?:@[\w./-]+)?$")


class ModelNotCachedError(UserError, FileNotFoundError):
    """A Hub id that the local Hugging Face cache does not hold."""


def is_hub_id(value: str | os.PathLike) -> bool:
    """Whether a model ``path:`` is spelled like a Hub id (``org/name[@revision]``)."""
    return isinstance(value, str) and _HUB_ID.match(value) is not None


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub finds it, read now (huggingface_hub
    reads its constants once, at import): ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (under ``XDG_CACHE_HOME`` when set)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "huggingface" / "hub"


def hub_snapshot(hub_id: str) -> Path:
    """The local snapshot directory of ``org/name[@revision]`` in the Hugging Face cache
    (revision: a branch, tag or commit; default ``main``). Never downloads: raises
    :class:`ModelNotCachedError` (a ``FileNotFoundError``) when the cache lacks it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo_id, _, revision = hub_id.partition("@")
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache,
                                      local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as err:
        raise ModelNotCachedError(
            f"{hub_id!r} is not a local directory and not in the Hugging Face cache "
            f"(HF_HUB_CACHE={cache}); download it first with `hf download {repo_id}"
            f"{' --revision ' + revision if revision else ''}`") from err


def local_model_dir(path: str | os.PathLike) -> Path:
    """``path`` itself when it exists (or is no Hub id), else the cached snapshot of the
    Hub id it spells: resolved where it is called, so each worker reads its own cache."""
    if Path(path).exists() or not is_hub_id(path):
        return Path(path)
    return hub_snapshot(str(path))
