"""Fit the analytic cost model's CPU constants (``costmodel.CPU_DEVICE``) to measured tasks.

Without a profile, ``placement: auto`` plans with the analytic model alone, and every run
prints its predicted against its measured iteration time. This script measures, on this
machine, how far the analytic model is from real tasks and which constants bring it
closest: it profiles each config (``rlhfflow profile``: every worker layout, co-located
and interleaved, so each stage is measured at two row counts, alone and in a gang), or
reads profiles made before, then fits

    flops_per_s, step_s, layer_s, row_step_s, task_s, train_step_s,
    train_factor, thread_efficiency, contention

by minimising the squared log error of the analytic estimate against the median measured
time of every (config, stage, rows, threads, gang, contended) group, each weighted by its share of
its config's time (Nelder-Mead in log space), and
prints per group the measured time and the estimate with the current and with the fitted
constants. The last line is one JSON object: the fitted constants and the median and
worst absolute errors before and after. Copy the constants into ``CPU_DEVICE`` when they
describe the machines the defaults are for.

    python benchmarks/calibrate.py [--configs grpo-tiny,ppo-tiny,grpo-small]
                                   [--profiles FILE ...] [--iterations N] [--save-dir DIR]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.shared import emit_result  # noqa: E402

FITTED = ("flops_per_s", "step_s", "layer_s", "row_step_s", "task_s",
          "train_step_s", "train_factor", "thread_efficiency", "contention")


def groups_of(model, observations) -> dict[tuple[str, int, int, int, bool], float]:
    """Median measured seconds per (stage, rows, threads, gang, contended) of stages with
    a model (model-free stages and stores are ~1 ms and follow other constants);
    ``model``: the pipeline's ``CostModel`` on the profile's machine. Observations
    without their worker count (older profiles) count as contended, as their layouts
    were."""
    grouped = defaultdict(list)
    for o in observations:
        node = model.graph.nodes.get(o.stage)
        if node is None or not node.model:
            continue
        contended = model.contended(o.workers, o.threads) if o.workers else True
        grouped[(o.stage, o.rows, o.threads, o.gang, contended)].append(o.seconds)
    return {k: statistics.median(v) for k, v in grouped.items()}


def to_vector(device: dict[str, float]) -> list[float]:
    out = []
    for key in FITTED:
        value = device[key]
        if key == "thread_efficiency":
            value = min(max(value, 1e-3), 1 - 1e-3)
            out.append(math.log(value / (1 - value)))
        else:
            out.append(math.log(max(value, 1e-9)))
    return out


def from_vector(base: dict[str, float], x: list[float]) -> dict[str, float]:
    device = dict(base)
    for key, value in zip(FITTED, x, strict=True):
        device[key] = 1 / (1 + math.exp(-value)) if key == "thread_efficiency" \
            else math.exp(value)
    return device


def errors(cases, device, weighted: bool = False) -> list[float]:
    """log(estimate / measured) of every group; ``weighted``: times the square root of
    the group's share of its config's measured time (a config's long tasks decide its
    iteration time; each config counts alike)."""
    out = []
    for model, groups in cases:
        model.device = device
        total = sum(groups.values())
        for (stage, rows, threads, gang, contended), seconds in groups.items():
            error = math.log(model.analytic(stage, rows, threads, gang, contended) / seconds)
            out.append(error * math.sqrt(seconds / total) if weighted else error)
    return out


def nelder_mead(f, x0: list[float], step: float = 0.7, iterations: int = 3000) -> list[float]:
    """Minimise ``f`` from ``x0`` (the textbook simplex method; a few dozen parameters
    at most)."""
    n = len(x0)
    simplex = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)]
                            for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-10:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]

        worst = simplex[-1]

        def towards(t: float, centroid=centroid, worst=worst) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, worst, strict=True)]

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best
                simplex = [simplex[0]] + [[b + 0.5 * (v - b) for b, v in
                                           zip(simplex[0], x, strict=True)]
                                          for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def fit(cases, before: dict[str, float]) -> dict[str, float]:
    """The constants (``FITTED``; the others as in ``before``) that minimise the weighted
    squared log error of ``cases``: ``(CostModel, {(stage, rows, threads, gang,
    contended): measured seconds})`` pairs."""
    start = {**before, "row_step_s": max(before["row_step_s"], 1e-5),
             "train_step_s": max(before["train_step_s"], 1e-3),
             "contention": max(before["contention"], 0.05)}
    return from_vector(before, nelder_mead(
        lambda x: sum(e * e for e in errors(cases, from_vector(before, x), weighted=True)),
        to_vector(start)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="grpo-tiny,ppo-tiny,grpo-small",
                        help="configs/NAME.yaml to profile (comma-separated)")
    parser.add_argument("--profiles", nargs="*", default=[],
                        help="profiles made before (rlhfflow profile -o FILE); their "
                             "pipeline's configs/NAME.yaml is loaded")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--save-dir", type=Path, help="keep the profiles made here")
    args = parser.parse_args()

    from rlhfflow.config import load_pipeline
    from rlhfflow.plan.auto.costmodel import CPU_DEVICE, CostModel, Profile
    from rlhfflow.runtime.profiler import profile_pipeline

    profiles: list[tuple[Path, Profile]] = []
    for path in args.profiles:
        profile = Profile.load(Path(path))
        profiles.append((ROOT / "configs" / f"{profile.pipeline}.yaml", profile))
    if not args.profiles:
        for name in args.configs.split(","):
            config = ROOT / "configs" / f"{name}.yaml"
            profile = profile_pipeline(load_pipeline(config), iterations=args.iterations)
            if args.save_dir:
                profile.save(args.save_dir / f"{name}.json")
            profiles.append((config, profile))

    cases = []
    for config, profile in profiles:
        model = CostModel(load_pipeline(config), cores=profile.machine.get("cores"))
        cases.append((model, groups_of(model, profile.observations)))
    before = dict(CPU_DEVICE)
    fitted = fit(cases, before)

    print(f"{'config':<12} {'stage':<14} {'rows':>5} {'thr':>3} {'gang':>4} {'shared':>6} "
          f"{'measured':>9} {'before':>9} {'fitted':>9}")
    for (config, _), (model, groups) in zip(profiles, cases, strict=True):
        for (stage, rows, threads, gang, contended), seconds in sorted(groups.items()):
            model.device = before
            old = model.analytic(stage, rows, threads, gang, contended)
            model.device = fitted
            new = model.analytic(stage, rows, threads, gang, contended)
            print(f"{config.stem:<12} {stage:<14} {rows:>5} {threads:>3} {gang:>4} "
                  f"{'yes' if contended else 'no':>6} {seconds:>9.4f} {old:>9.4f} {new:>9.4f}")
    summary = {}
    for label, device in (("before", before), ("fitted", fitted)):
        errs = [abs(math.expm1(e)) for e in errors(cases, device)]
        summary[label] = {"median_error": round(statistics.median(errs), 3),
                          "worst_error": round(max(errs), 3)}
    print(f"median |error|: before {summary['before']['median_error']:.0%}, fitted "
          f"{summary['fitted']['median_error']:.0%}; worst: before "
          f"{summary['before']['worst_error']:.0%}, fitted "
          f"{summary['fitted']['worst_error']:.0%}")
    summary["constants"] = {k: float(f"{fitted[k]:.3g}") for k in FITTED}
    summary["configs"] = [c.stem for c, _ in profiles]
    emit_result(summary, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
