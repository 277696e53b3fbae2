"""The summary of an evaluation run: a pipeline whose loop trains nothing, so its
iterations only generate and score (``configs/eval-tiny.yaml``). The mean reward and each
reward function's mean over every sample of the run, weighted by the samples of each
iteration, as a dict and the one line the run ends with."""

from __future__ import annotations

from typing import Any

from rlhfflow.config.graph import StageGraph


def evaluation_summary(graph: StageGraph, records: list[dict[str, Any]]
                       ) -> tuple[dict[str, Any], str] | None:
    """``(summary, line)`` over ``records`` (this run's iterations) when no loop stage
    trains a model and something was scored; else None."""
    if graph.loop_trained() or not records:
        return None
    scored = [r for r in records if r.get("reward_mean") is not None]
    samples = sum(r["samples"] - r.get("samples_skipped", 0) for r in scored)
    if not samples:
        return None

    def mean(key: str) -> float:
        return sum(r[key] * (r["samples"] - r.get("samples_skipped", 0))
                   for r in scored) / samples

    names = sorted({k for r in scored for k in r if k.startswith("reward_mean_")})
    summary = {"samples": samples, "reward_mean": mean("reward_mean"),
               **{k: mean(k) for k in names}}
    per_function = ", ".join(f"{k.removeprefix('reward_mean_')} {summary[k]:.4f}"
                             for k in names)
    line = (f"rlhfflow: evaluation over {samples} samples: reward mean "
            f"{summary['reward_mean']:.4f}" + (f" ({per_function})" if per_function else ""))
    return summary, line
