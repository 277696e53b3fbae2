"""Errors that more than one layer of rlhfflow raises."""

from __future__ import annotations

from pathlib import Path


class SpecError(Exception):
    """A mistake in a pipeline file: the file, the key path and what was expected."""

    def __init__(self, file: str | Path, path: str, message: str) -> None:
        self.file, self.path, self.message = str(file), path, message
        where = f"{self.file}: {path}: " if path else f"{self.file}: "
        super().__init__(where + message)
