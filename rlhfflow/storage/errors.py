"""``OUTPUT/score_errors/``: the samples a reward function raised on and that were skipped
(``on_error: skip``), one JSON line each: iteration, row, the error's one line, prompt and
response.

Every micro-batch's store task writes its own file (``<iteration>-<first row>.jsonl``),
so no two processes ever write one file; a micro-batch with no error removes its file,
so a recomputed iteration (after a resume) never keeps the listing of an earlier try.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DIRECTORY = "score_errors"
TEXT_LIMIT = 200  # characters of prompt and response kept: enough to recognise a sample


def _file(out: Path, iteration: int, start_row: int) -> Path:
    return Path(out) / DIRECTORY / f"{iteration:06d}-{start_row:06d}.jsonl"


def write_score_errors(out: str | Path, iteration: int, start_row: int,
                       errors: Sequence[str], prompts: Sequence[str] | None = None,
                       responses: Sequence[str] | None = None) -> int:
    """List the micro-batch's failed samples (``errors[i]`` non-empty) and return how
    many; atomically replaces (or removes) this micro-batch's earlier listing."""
    target = _file(Path(out), iteration, start_row)
    lines = []
    for i, error in enumerate(errors):
        if not error:
            continue
        record: dict[str, Any] = {"iteration": iteration, "row": start_row + i, "error": error}
        if prompts is not None:
            record["prompt"] = prompts[i][:TEXT_LIMIT]
        if responses is not None:
            record["response"] = responses[i][:TEXT_LIMIT]
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    if not lines:
        target.unlink(missing_ok=True)
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_suffix(f".tmp{os.getpid()}")
    staged.write_text("".join(lines), encoding="utf-8")
    os.replace(staged, target)
    return len(lines)


def read_score_errors(out: str | Path) -> list[dict[str, Any]]:
    """Every listed failed sample, by iteration and row."""
    folder = Path(out) / DIRECTORY
    records = [json.loads(line) for path in sorted(folder.glob("*.jsonl"))
               for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(records, key=lambda r: (r["iteration"], r["row"]))


def truncate_score_errors(out: str | Path, keep: int) -> None:
    """Forget the listings of iterations after ``keep`` (-1: all), as a resume does."""
    for path in (Path(out) / DIRECTORY).glob("*"):
        match = _NAME.match(path.name)
        if match and (match[2] or int(match[1]) > keep):  # a staged file is a torn write
            path.unlink(missing_ok=True)


_NAME = re.compile(r"^(\d+)-\d+(?:\.jsonl|(\.tmp\d+))$")
