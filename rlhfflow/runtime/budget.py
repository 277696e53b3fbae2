"""The error budget of reward functions that raise (``score`` stage, ``on_error: skip``).

A skipped sample costs one sample; a reward function that raises on most of them is a bug,
and a run that skips everything learns nothing. So the coordinator stops the run once an
iteration has more than ``params.max_errors`` failed samples, or the run more than
``params.max_errors_total`` (counted from ``OUTPUT/score_errors/``, so a resumed run
counts what the iterations it kept already spent).
"""

from __future__ import annotations

from pathlib import Path

from rlhfflow.config.loader import Pipeline
from rlhfflow.storage.errors import DIRECTORY, read_score_errors


def skipping_stage(pipeline: Pipeline) -> str | None:
    """The loop's scorer (``Stage.scores``) that skips samples its function raises on, if
    any (one at most: two scorers would both write ``scores``)."""
    for name in pipeline.graph.scorers():
        if not pipeline.graph.nodes[name].once and \
                getattr(pipeline.params[name], "on_error", "error") == "skip":
            return name
    return None


def errors_listed(out: str | Path, up_to: int) -> int:
    """Failed samples listed for iterations ``<= up_to``."""
    return sum(1 for r in read_score_errors(out) if r["iteration"] <= up_to)


def score_error_budget(pipeline: Pipeline, out: str | Path, iteration: int,
                       errors: int) -> str | None:
    """Why the run must stop after ``iteration`` (which had ``errors`` failed samples, the
    ``score_errors`` partial sum), as one line; None while within the budget."""
    stage = skipping_stage(pipeline)
    if stage is None or not errors:
        return None
    params = pipeline.params[stage]
    listing = Path(out) / DIRECTORY
    if errors > params.max_errors:
        return (f"stage {stage!r}: the reward function raised on {errors} samples in "
                f"iteration {iteration}, more than stages.{stage}.params.max_errors="
                f"{params.max_errors} (listed in {listing}); fix the function or raise the "
                f"budget")
    total = errors_listed(out, iteration)
    if total > params.max_errors_total:
        return (f"stage {stage!r}: the reward function raised on {total} samples so far, "
                f"more than stages.{stage}.params.max_errors_total="
                f"{params.max_errors_total} (listed in {listing}); fix the function or "
                f"raise the budget")
    return None
