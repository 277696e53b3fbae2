"""Streaming rollouts on a long-tailed multi-turn workload: the same episodes, model, seed
and trained samples on 2 workers, run three ways on one embedded Dask cluster:

- ``sync``: today's default (colocated on both workers, strictly on-policy): each
  iteration's rollout waits for its slowest episode, then training;
- ``async``: ``max_staleness: 1`` on a disaggregated plan (one worker generates iteration
  k+1 while the other trains on k), today's asynchrony;
- ``stream``: the rollout's ``stream: true`` (colocated, ``max_staleness: 1``, truncated
  importance sampling) in finish order, the default: a task returns the groups that
  finished first, whichever iteration's prompts they answer (twice its rows in flight),
  and episodes go on across the weight update;
- ``stream-it``: the same with ``stream_order: iteration``: a task returns its own
  iteration's episodes (waiting for its slowest), the next iteration's starting in the
  room they leave.

The workload (``longtail_env.py``): episodes of 1 to 8 turns (each prompt's own count),
each environment step sleeping a lognormal time around 50 ms (sigma 0.8), on threads
(``env_workers``) so steps overlap decoding; a tiny random Llama that learns to say
vowels. Each mode runs ``--rounds`` times, alternating, so drift of the machine hits all
alike; round r runs every mode with seed r. Figures per run: trained episodes per second
over the steady iterations (the first, which loads models, left out), the reward curve,
and for the streams the decode batch's occupancy, the episodes in flight, the token lag
and (finish order) the share of rows owed from an earlier iteration and the seconds a
task waited for owed groups or for enough finished ones. Then the median over rounds of each figure and of the per-round ratios against
``sync``; and beside each mode's measured seconds per iteration the planner's
prediction, from the analytic cost model (the environment's mean step time declared in
``env_step_s``) and from a profile of the ``sync`` runs' tasks (as ``rlhfflow profile
--from-run`` makes it).

    python benchmarks/longtail.py [--iterations 12] [--rounds 3] [--in-flight N]
                                  [--staleness N]

Prints a table, then one JSON object with the figures as its last line. The goal
(issue 44), reported and not asserted: ``stream`` at least 1.6x ``sync``'s trained
episodes per second, with its reward per trained sample within noise of ``sync``'s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
from pathlib import Path

import yaml
from longtail_env import LongTail
from shared import check_gangs, emit_result, shared_cluster

from rlhfflow.config import load_pipeline
from rlhfflow.config.shapes import model_shapes
from rlhfflow.plan.auto.costmodel import Profile, machine_info
from rlhfflow.plan.auto.planner import plan_for_cli
from rlhfflow.runtime.profiler import observations_from_run
from rlhfflow.runtime.run import run_pipeline

HERE = Path(__file__).resolve().parent
GOAL = 1.6  # stream's trained episodes per second / sync's
BATCH, SAMPLES = 8, 4
MODES = {
    "sync": {"placement.strategy": "colocated"},
    "async": {"overlap.max_staleness": 1, "placement.strategy": "disaggregated"},
    "stream": {"placement.strategy": "colocated", "overlap.max_staleness": 1,
               "stages.rollout.params.stream": True,
               "algorithm.off_policy": {"correction": "tis", "cap": 2.0}},
}
# the stream returning its own iteration's episodes (it waits for its slowest)
MODES["stream-it"] = {**MODES["stream"], "stages.rollout.params.stream_order": "iteration"}
STREAMS = ("stream", "stream-it")


def write_pipeline(directory: Path, prompts: int = 96) -> Path:
    """The workload's pipeline and prompts file in ``directory``."""
    rng, env = random.Random(0), LongTail()
    words = ["say", "tell", "sing", "call", "name", "spell"]
    with (directory / "prompts.jsonl").open("w") as f:
        for i in range(prompts):
            f.write(json.dumps({"prompt": f"{rng.choice(words)} {rng.choice(words)}:",
                                "turns": rng.randint(1, 8), "id": i}) + "\n")
    config = {
        "name": "longtail", "seed": 0, "iterations": 12,
        "cluster": {"workers": 2},
        "data": {"prompts": "prompts.jsonl", "batch_size": BATCH,
                 "samples_per_prompt": SAMPLES},
        "models": {"actor": {"tiny": {"layers": 2, "hidden": 64, "heads": 4},
                             "trainable": True, "optimizer": {"lr": 3.0e-3}}},
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        "stages": {
            "rollout": {"type": "rollout", "model": "actor", "params": {
                "env": f"{HERE / 'longtail_env.py'}:LongTail", "max_turns": 8,
                "max_new_tokens": 4, "max_tokens": 64, "plain_separator": " ",
                "scores": True, "env_workers": BATCH * SAMPLES,
                # the planner's figure: the mean of the steps' lognormal time
                "env_step_s": round(env.median_s * math.exp(env.sigma ** 2 / 2), 4)}},
            "advantages": {"type": "advantages", "after": ["rollout"]},
            "train_actor": {"type": "train_actor", "model": "actor",
                            "after": ["advantages"],
                            "params": {"epochs": 1, "minibatches": 1}}}}
    path = directory / "longtail.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_once(config: Path, mode: str, out: Path, settings: dict) -> dict:
    """One run of ``mode``; its per-iteration rewards and steady-state figures."""
    pipeline = load_pipeline(config, {**settings, **MODES[mode], "output": str(out)})
    metrics = run_pipeline(pipeline, progress=False, overwrite=True).metrics
    steady = metrics[1:]
    seconds = sum(m["iteration_s"] for m in steady)
    stale = [m["staleness_max"] for m in metrics if m["staleness_max"] is not None]
    figures = {"episodes_per_s": len(steady) * BATCH * SAMPLES / seconds,
               "iteration_s": seconds / len(steady),
               "rewards": [m["reward_mean"] for m in metrics],
               "staleness_max": max(stale) if stale else 0}
    if mode in STREAMS:
        for key in ("decode_occupancy", "episodes_in_flight", "token_lag_mean",
                    "started_ahead_frac", "deferred_frac", "stream_wait_owed_s",
                    "stream_wait_groups_s"):
            if key in steady[0]:
                figures[key] = statistics.mean(m[key] for m in steady)
        figures["dropped"] = sum(m["episodes_dropped"] for m in metrics)
    return figures


def predicted(config: Path, mode: str, settings: dict, profile: Profile | None) -> float:
    """The planner's seconds per iteration of ``mode`` (its simulation of the plan)."""
    pipeline = load_pipeline(config, {**settings, **MODES[mode]})
    return plan_for_cli(pipeline, profile, None).best.predicted_s


def predictions(config: Path, settings: dict, sync_runs: list[Path]) -> dict[str, dict]:
    """Per mode, the analytic and the profile-based prediction (the profile: every task
    the ``sync`` runs recorded, the first iteration left out)."""
    pipeline = load_pipeline(config, settings)
    profile = Profile(pipeline.name, machine_info(),
                      {m: s.__dict__ for m, s in model_shapes(pipeline).items()})
    for run in sync_runs:
        profile.observations += observations_from_run(run)
    return {mode: {"analytic_s": round(predicted(config, mode, settings, None), 4),
                   "profile_s": round(predicted(config, mode, settings, profile), 4)}
            for mode in MODES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=None,
                        help="stream_in_flight of the stream mode (default: the task's rows)")
    parser.add_argument("--staleness", type=int, default=1,
                        help="max_staleness of the stream mode: how many iterations ahead "
                             "its episodes may start")
    args = parser.parse_args()
    if args.iterations < 3 or args.rounds < 1:
        parser.error("--iterations must be at least 3 and --rounds at least 1")
    for mode in STREAMS:
        if args.in_flight is not None:
            MODES[mode]["stages.rollout.params.stream_in_flight"] = args.in_flight
        MODES[mode]["overlap.max_staleness"] = args.staleness
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        config = write_pipeline(Path(tmp))
        check_gangs(config, 2, MODES)
        with shared_cluster(2, args.iterations) as (threads, settings):
            for r in range(args.rounds):
                for mode in MODES:
                    # round r runs every mode with seed r: the rounds' spread is the
                    # noise a mode's reward is compared with, each ratio same-seeded
                    runs[mode].append(run_once(config, mode, Path(tmp) / f"{mode}-{r}",
                                               {**settings, "seed": r}))
            plans = predictions(config, settings,
                                [Path(tmp) / f"sync-{r}" for r in range(args.rounds)])

    def med(mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[mode])

    def ratio(mode: str) -> float:  # per round against sync, then the median
        return statistics.median(a["episodes_per_s"] / b["episodes_per_s"]
                                 for a, b in zip(runs[mode], runs["sync"], strict=True))

    third = max(1, args.iterations // 3)

    def late_reward(mode: str) -> float:  # the last third of the iterations
        return statistics.median(statistics.mean(run["rewards"][-third:])
                                 for run in runs[mode])

    print(f"long-tail workload: {BATCH} prompts x {SAMPLES} samples, 1-8 turns, steps "
          f"lognormal around 50 ms; {args.iterations} iterations x {args.rounds} rounds, "
          f"2 workers, {threads} torch thread(s) each")
    print(f"{'mode':<9} {'episodes/s':>11} {'vs sync':>8} {'reward first':>13} "
          f"{'reward last third':>18} {'stale max':>10}")
    for mode in MODES:
        print(f"{mode:<9} {med(mode, 'episodes_per_s'):>11.2f} {ratio(mode):>8.3f} "
              f"{statistics.median(r['rewards'][0] for r in runs[mode]):>13.4f} "
              f"{late_reward(mode):>18.4f} {max(r['staleness_max'] for r in runs[mode]):>10}")
    spread = [statistics.mean(r["rewards"][-third:]) for r in runs["sync"]]
    streams = {}
    for mode in STREAMS:
        figures = streams[mode] = {k: round(med(mode, k), 4) for k in runs[mode][0]
                                   if k not in ("rewards", "staleness_max", "dropped",
                                                "episodes_per_s", "iteration_s")}
        figures["dropped"] = sum(r["dropped"] for r in runs[mode])
        print(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    print(f"sync's late reward over rounds: {min(spread):.4f} .. {max(spread):.4f}")
    print(f"{'mode':<9} {'s/iteration':>12} {'analytic':>9} {'error':>7} "
          f"{'profile':>8} {'error':>7}   (predicted; profile: of the sync runs' tasks)")
    for mode in MODES:
        measured = plans[mode]["measured_s"] = round(med(mode, "iteration_s"), 4)
        errors = [plans[mode][k] / measured - 1 for k in ("analytic_s", "profile_s")]
        print(f"{mode:<9} {measured:>12.3f} {plans[mode]['analytic_s']:>9.3f} "
              f"{errors[0]:>+7.0%} {plans[mode]['profile_s']:>8.3f} {errors[1]:>+7.0%}")
    met = ratio("stream") >= GOAL
    print(f"goal: stream >= {GOAL} x sync's trained episodes per second: "
          f"{ratio('stream'):.3f} ({'met' if met else 'not met'})")
    emit_result({
        **{f"{m}_episodes_per_s": round(med(m, "episodes_per_s"), 3) for m in MODES},
        **{f"{m}_vs_sync": round(ratio(m), 4) for m in MODES if m != "sync"},
        "rounds_stream_vs_sync": [round(a["episodes_per_s"] / b["episodes_per_s"], 4)
                                  for a, b in zip(runs["stream"], runs["sync"], strict=True)],
        **{f"{m}_late_reward": round(late_reward(m), 4) for m in MODES},
        "sync_late_reward_range": [round(min(spread), 4), round(max(spread), 4)],
        "stream": streams["stream"], "stream_iteration": streams["stream-it"],
        "stream_in_flight": args.in_flight,
        "stream_max_staleness": args.staleness, "predicted": plans,
        "iterations": args.iterations, "rounds": args.rounds, "goal_met": met}, __file__)


if __name__ == "__main__":
    main()
