"""Held-out scores of a pipeline's model: its generating and reward stages run alone, in
this process (as `rlhfflow stage test` runs them), on held-out records, for each model
given; nothing is trained or written.

    python examples/multiturn/heldout.py examples/multiturn/python.yaml \
        --model models/smollm2-135m --model runs/multiturn-python/models/actor/final

A pipeline without a score stage whose rollout scores itself (an agent's reward,
``scores: true``) is scored by its reward and ``info`` columns.

The held-out records are the file beside the pipeline's prompts with `-test` for `-train`
(what the examples' make_data.py writes), or `--prompts FILE`. It prints, per model, each
reward function's mean over the held-out episodes with its standard error, and as its
last line one JSON object of the figures. The episodes sample at the pipeline's
temperature with its seed: the same draws for every model.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from rlhfflow.config.loader import load_pipeline
from rlhfflow.runtime.stagetest import run_stage_alone


def heldout(config: Path, model: str | None, records: int, batch: int, samples: int,
            prompts: str | None = None) -> dict[str, list[float]]:
    """Each reward function's score (``scores`` where the stage has one function) per
    held-out episode: ``samples`` episodes of each of the first ``records`` held-out
    records (a group estimator takes no fewer than 2), ``batch`` records at a time;
    ``model`` replaces the path of the generating stage's model (None: the pipeline's)."""
    pipeline = load_pipeline(config)
    generator = pipeline.graph.generators()[0]
    actor = pipeline.graph.nodes[generator].model
    if prompts is None:
        train = str(pipeline.spec.data.prompts)
        if "-train" not in Path(train).name:
            raise SystemExit(f"{config}: data.prompts {train!r} has no -train in its name; "
                             f"give the held-out records with --prompts")
        test = Path(train).with_name(Path(train).name.replace("-train", "-test"))
        prompts = str(test if test.is_absolute() else Path(pipeline.base_dir) / test)
    overrides: dict[str, Any] = {
        "data.prompts": str(Path(prompts).resolve()), "data.batch_size": batch,
        "data.samples_per_prompt": samples, "data.shuffle": False, "data.micro_batches": 1}
    if model is not None:
        overrides[f"models.{actor}.path"] = str(Path(model).resolve())
    pipeline = load_pipeline(config, overrides)
    if pipeline.graph.scorers():
        scorer = pipeline.graph.scorers()[0]
        # the columns of the functions a stage lists under ``functions``
        # (``score_<name>``); a single ``function`` writes ``scores`` alone
        named = {entry.column[len("score_"):]: entry.column
                 for entry in getattr(pipeline.params[scorer], "functions", [])}
    else:  # a rollout that scores itself (scores: true): its reward and info columns
        scorer = generator
        named = {"reward": "env_reward", **{key: f"info_{key}" for key in
                                            getattr(pipeline.params[scorer], "info", [])}}
    scores: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as work:
        for iteration in range(records // batch):
            columns = run_stage_alone(pipeline, scorer, iteration, Path(work)).columns
            for name, column in (named or {"scores": "scores"}).items():
                scores.setdefault(name, []).extend(float(v) for v in columns[column].tolist())
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="the pipeline file")
    parser.add_argument("--model", action="append",
                        help="a checkpoint directory; give several to compare them "
                             "(none: the pipeline's own model)")
    parser.add_argument("--prompts", help="the held-out records (default: the prompts "
                                          "file with -test for -train)")
    parser.add_argument("--records", type=int, default=48, help="held-out records")
    parser.add_argument("--batch", type=int, default=8, help="records decoded together")
    parser.add_argument("--samples", type=int, default=2, help="episodes per record")
    args = parser.parse_args()
    figures = {}
    print(f"{'model':<48} {'function':<14} {'mean':>6} {'stderr':>7}")
    for model in args.model or [None]:
        shown = model or "(the pipeline's)"
        for name, values in heldout(args.config, model, args.records, args.batch,
                                    args.samples, args.prompts).items():
            mean = sum(values) / len(values)
            # per episode, as if independent (the episodes of one record are not quite);
            # the binomial error where scores are 0 or 1, else the sample's
            if all(v in (0.0, 1.0) for v in values):
                stderr = math.sqrt(mean * (1 - mean) / len(values))
            else:
                var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
                stderr = math.sqrt(var / len(values))
            print(f"{shown[-48:]:<48} {name:<14} {mean:6.3f} {stderr:7.3f}")
            figures[f"{shown}:{name}"] = {"mean": round(mean, 4), "stderr": round(stderr, 4),
                                          "episodes": len(values)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
