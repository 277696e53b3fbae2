"""Sample reallocation: the generate stage's span with ``migrate`` on and off, side by side.

A generation-only pipeline (``generate`` + ``score``) on a tiny random Llama whose rows
end at EOS after very different numbers of steps, run on one embedded Dask cluster of
``--workers`` device workers with ``--micro-batches`` generate tasks per iteration
(3 tasks on 2 workers: one worker decodes two of them while the other would idle through
the second), co-located and sequential (each stage waits for the previous one, so nothing
else runs beside generation), once with ``migrate: false`` and once with ``migrate: true``.

Per variant: the median over steady iterations (not the first) of the generate span (the
first generate task's start to the last generate interval's end, continuations included,
from ``tasks.jsonl``), of the iteration time, and the rows moved per iteration; then
whether every response token and reward of the two runs is equal. The last line is one
JSON object with the figures.

    python benchmarks/reallocation.py [--iterations 8] [--workers 2] [--micro-batches 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.shared import emit_result, shared_cluster  # noqa: E402
from rlhfflow.config import load_pipeline  # noqa: E402
from rlhfflow.runtime.run import run_pipeline  # noqa: E402


def pipeline(args: argparse.Namespace, out: Path, migrate: bool) -> dict:
    return {
        "name": f"reallocation-{'on' if migrate else 'off'}",
        "seed": 0,
        "iterations": args.iterations,
        "output": str(out),
        "data": {"prompts": str(ROOT / "configs" / "data" / "prompts.jsonl"),
                 "batch_size": args.prompts, "samples_per_prompt": args.samples,
                 "micro_batches": args.micro_batches},
        "models": {"actor": {"tiny": {"layers": args.layers, "hidden": args.hidden,
                                      "heads": 4}}},
        "placement": {"strategy": "colocated"},
        # each stage and iteration waits for the previous one: nothing else runs while
        # the generate tasks do, so their span is the stage's time
        "overlap": {"sequential": True},
        "stages": {
            "generate": {"type": "generate", "model": "actor",
                         "params": {"max_new_tokens": args.tokens, "migrate": migrate,
                                    "migrate_min_s": args.min_s}},
            "reward": {"type": "score", "after": ["generate"],
                       "params": {"function": "rlhfflow.stages.rewards:vowel_ratio"}},
        },
    }


def spans(run_dir: Path) -> dict[int, float]:
    """Seconds from the first generate task's start to the last generate interval's
    end, per iteration."""
    times: dict[int, list[tuple[float, float]]] = {}
    for line in (run_dir / "tasks.jsonl").read_text().splitlines():
        for _worker, stage, iteration, start, stop, _rows in json.loads(line)["tasks"]:
            if stage == "generate":
                times.setdefault(iteration, []).append((start, stop))
    return {k: max(b for _, b in v) - min(a for a, _ in v) for k, v in times.items()}


def buffer_columns(run_dir: Path, column: str) -> list:
    import zarr

    group = zarr.open_group(str(run_dir / "buffer.zarr"), mode="r")
    return [group[name][column][:] for name in sorted(group.group_keys())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--min-s", type=float, default=0.05, help="params.migrate_min_s")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a "
                                                     "temporary directory)")
    args = parser.parse_args()

    rows = {}
    with tempfile.TemporaryDirectory() as scratch, \
            shared_cluster(args.workers, args.iterations) as (_, settings):
        tmp = args.workdir or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for migrate in (False, True):
            name = "on" if migrate else "off"
            out = Path(tmp) / name
            path = Path(tmp) / f"{name}.yaml"
            data = pipeline(args, out, migrate)
            data["cluster"] = {"address": settings["cluster.address"],
                               "workers": args.workers,
                               "torch_threads": settings["cluster.torch_threads"]}
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            records = run_pipeline(load_pipeline(path), progress=False,
                                   overwrite=True).metrics
            steady = [r for r in records if r["iteration"] > 0]
            span = spans(out)
            rows[name] = {
                "generate_span_s": statistics.median(span[r["iteration"]] for r in steady),
                "iteration_s": statistics.median(r["iteration_s"] for r in steady),
                "rows_moved": statistics.mean(r.get("gen_rows_migrated") or 0
                                              for r in steady),
                "rewards": [r["reward_mean"] for r in records],
                "tokens": buffer_columns(out, "response_ids"),
            }
    import numpy as np

    same_tokens = all(np.array_equal(a, b) for a, b in
                      zip(rows["off"]["tokens"], rows["on"]["tokens"], strict=True))
    same_rewards = rows["off"]["rewards"] == rows["on"]["rewards"]
    print(f"{args.workers} workers, {args.micro_batches} generate tasks per iteration, "
          f"{args.prompts * args.samples} rows x {args.tokens} tokens, "
          f"median of iterations 1-{args.iterations - 1}")
    print(f"{'migrate':<10}{'generate span s':>18}{'iteration s':>14}{'rows moved':>12}")
    for name, row in rows.items():
        print(f"{name:<10}{row['generate_span_s']:>18.3f}{row['iteration_s']:>14.3f}"
              f"{row['rows_moved']:>12.1f}")
    ratio = rows["off"]["generate_span_s"] / rows["on"]["generate_span_s"]
    print(f"speed-up of the generate span: {ratio:.2f}x; same tokens: {same_tokens}; "
          f"same rewards: {same_rewards}")
    emit_result({
        "workers": args.workers, "micro_batches": args.micro_batches,
        "span_off_s": round(rows["off"]["generate_span_s"], 4),
        "span_on_s": round(rows["on"]["generate_span_s"], 4),
        "span_speedup": round(ratio, 3),
        "iteration_off_s": round(rows["off"]["iteration_s"], 4),
        "iteration_on_s": round(rows["on"]["iteration_s"], 4),
        "rows_moved_per_iteration": round(rows["on"]["rows_moved"], 2),
        "same_tokens": same_tokens, "same_rewards": same_rewards}, __file__)


if __name__ == "__main__":
    main()
