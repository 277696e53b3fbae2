"""``rlhfflow profile``: measure a pipeline's stages on this machine for the planner.

A profile is made of the task intervals real runs record (``OUTPUT/tasks.jsonl``: stage,
rows, seconds, on which worker) together with the layout they ran under (workers, torch
threads per worker, gang sizes). The profiling pass runs the pipeline for a few
iterations under two plans per worker layout (co-located, whose training runs in gangs,
and interleaved, whose micro-batches are smaller and whose training runs alone), so every
stage is measured at two row counts, alone and in a gang; the first iteration (model
loading) is left out. A finished run's intervals can be added to a profile later
(``--from-run``), so the profile improves with every run.
"""

from __future__ import annotations

import bisect
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rlhfflow.plan.auto.costmodel import Observation, Profile, machine_info, model_shapes
from rlhfflow.plan.layout import default_torch_threads, layouts
from rlhfflow.runtime.telemetry import TASKS_FILE


def observations_from_run(run_dir: Path, skip_first: bool = True) -> list[Observation]:
    """The measured stage tasks of a run directory (``tasks.jsonl``), without the first
    iteration's (model loading) unless ``skip_first`` is False."""
    path = Path(run_dir) / TASKS_FILE
    if not path.is_file():
        return []
    tasks = []
    env: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    first = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line
        layout = record.get("layout") or {}
        threads = int(layout.get("threads") or 1)
        gangs = layout.get("gangs") or {}
        for w, stage, iteration, start, stop, rows in record.get("tasks", []):
            if stage.endswith("/env"):  # a rollout's steps in its task's process
                env.setdefault((w, stage[:-4], iteration), []).append((start, stop))
                continue
            if "/" in stage:
                continue
            if first is None:
                first = iteration
            tasks.append((w, start, stop, stage, iteration, rows, threads,
                          int(gangs.get(stage, 1)), int(layout.get("workers") or 0)))
    busy, seen = _busy_at(tasks)
    lengths = _response_lengths(Path(run_dir) / "metrics.jsonl")
    out = []
    for w, start, stop, stage, iteration, rows, threads, gang, workers in tasks:
        if skip_first and iteration <= max(0, first):
            continue
        if stage == "realloc" or rows <= 0:
            continue
        if workers:  # the workers busy as it started, itself included (CostModel.contended)
            workers = min(workers, 1 + sum(busy(v, start) for v in seen if v != w))
        inside = sum(max(0.0, min(b, stop) - max(a, start))
                     for a, b in env.get((w, stage, iteration), ()))
        out.append(Observation(stage, int(rows), threads, gang, float(stop - start),
                               workers, lengths.get(iteration, 0.0), float(inside)))
    return out


def _response_lengths(path: Path) -> dict[int, float]:
    """Per iteration, the mean response length its metrics recorded (the work of a
    stage follows it, and a profile's first iterations are rarely a run's steady
    lengths); none where the log cannot be read."""
    from rlhfflow.storage import MetricsLog

    try:
        records = MetricsLog(path).read()
    except (OSError, ValueError):
        return {}
    return {int(r["iteration"]): float(r["response_length_mean"]) for r in records
            if "iteration" in r and r.get("response_length_mean")}


def _busy_at(tasks: list[tuple]) -> tuple[Callable[[int, float], bool], list[int]]:
    """``(busy, workers)``: ``busy(worker, t)`` says whether one of ``tasks`` (worker,
    start, stop, ...) ran on ``worker`` at time ``t``, ``workers`` are the workers seen.
    A worker's tasks follow one another, so the last one started by ``t`` is the only
    candidate."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for w, start, stop, *_ in tasks:
        spans.setdefault(w, []).append((start, stop))
    starts = {}
    for w, items in spans.items():
        items.sort()
        starts[w] = [a for a, _ in items]

    def busy(worker: int, t: float) -> bool:
        i = bisect.bisect_right(starts[worker], t) - 1
        return i >= 0 and spans[worker][i][1] > t

    return busy, list(spans)


def profile_pipeline(pipeline, iterations: int = 3,
                     worker_layouts: Sequence[tuple[int, int]] | None = None,
                     say: Callable[[str], None] = print) -> Profile:
    """Run ``pipeline`` briefly under each layout and two plans, on an embedded cluster,
    and return the profile of its stages."""
    from rlhfflow.config.pipeline import derive
    from rlhfflow.runtime.run import run_pipeline

    spec = pipeline.spec
    cores = machine_info()["cores"]
    chosen = list(worker_layouts or layouts(cores, spec.cluster.workers))
    rows = spec.data.batch_size * spec.data.samples_per_prompt
    profile = Profile(pipeline.name, machine_info(),
                      {m: s.__dict__ for m, s in model_shapes(pipeline).items()})
    if profile.machine.get("gpu_memory"):  # what one worker may hold, for the planner
        profile.device["memory_bytes"] = float(profile.machine["gpu_memory"])
    scratch = Path(tempfile.mkdtemp(prefix="rlhfflow-profile-"))
    try:
        runs = [(workers, threads or default_torch_threads(workers), strategy, micro)
                for workers, threads in chosen
                for strategy, micro in (("colocated", workers), ("interleaved", 4 * workers))]
        for i, (workers, threads, strategy, micro) in enumerate(runs):
            # a new folder per run, all deleted at the end: deleting the last run's
            # files as the next one writes slows its buffer writes on disks mounted
            # with `discard` (grpo-tiny's store: 6.3-8.1 ms after an overwrite,
            # 2.9-5.7 ms into a new folder), and the profile would keep that
            run_dir = scratch / f"run-{i}"
            overrides = {"iterations": iterations, "output": str(run_dir),
                         "cluster.workers": workers, "cluster.torch_threads": threads,
                         "cluster.address": None, "placement.strategy": strategy,
                         "data.micro_batches": min(rows, micro), "checkpoint.every": 0}
            say(f"rlhfflow profile: {workers} worker(s) x {threads} thread(s), "
                f"{strategy}, {min(rows, micro)} micro-batch(es)")
            start = time.time()
            run_pipeline(derive(pipeline, overrides), progress=False)
            found = observations_from_run(run_dir)
            profile.observations += found
            say(f"rlhfflow profile:   {len(found)} task(s) measured in "
                f"{time.time() - start:.1f}s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return profile
