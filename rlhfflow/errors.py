"""rlhfflow's errors: one family, two kinds.

``UserError``: a mistake in what the user gave (a pipeline file, a data file, a path, an
option): the command line prints its one line and exits 2. ``RunError``: the run cannot
go on (a stage failed, a worker stayed away, the disk is full): one line, exit 1. The
command line maps the family once (``rlhfflow.cli.main``); any other exception is a bug
and keeps its traceback.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable
from pathlib import Path


class RlhfflowError(Exception):
    """Base of rlhfflow's own errors; ``exit_code`` is what the command line exits with."""

    exit_code = 1


class UserError(RlhfflowError):
    """A mistake in what the user gave: one line naming the file, key or argument."""

    exit_code = 2


class RunError(RlhfflowError, RuntimeError):
    """The run cannot go on: names the stage, the iteration and the cause."""

    exit_code = 1


class SpecError(UserError):
    """A mistake in a pipeline file: the file, the key path and what was expected."""

    def __init__(self, file: str | Path, path: str, message: str) -> None:
        self.file, self.path, self.message = str(file), path, message
        where = f"{self.file}: {path}: " if path else f"{self.file}: "
        super().__init__(where + message)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: Python's ``MemoryError`` (numpy's
    too), torch's ``OutOfMemoryError`` (CUDA) or its CPU allocator's ``RuntimeError``,
    ENOMEM. Not a fault of the data or the code that asked: the machine is short."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text
                                              or "CUDA out of memory" in text)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` when a close match exists, else ``""``: the hint every
    one-line error about a misspelt name ends with."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""
