"""``rlhfflow profile FILE``: measure a pipeline's stages on this machine for the planner."""

from __future__ import annotations

from pathlib import Path

import click

from rlhfflow.cli.common import (
    OVERRIDES_ARGUMENT,
    SET_OPTION,
    UserError,
    load,
    parse_sets,
    pipeline_errors,
)


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@OVERRIDES_ARGUMENT
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), metavar="FILE",
              help="Where to write the profile (default: 'placement.profile', else "
                   "profiles/NAME.json beside the pipeline file).")
@click.option("--iterations", type=click.IntRange(min=2), default=3, show_default=True,
              help="Iterations per profiling run (the first, which loads the models, is "
                   "not measured).")
@click.option("--from-run", "from_runs", multiple=True, type=click.Path(file_okay=False),
              metavar="DIR", help="Add the task intervals a finished run recorded "
                                  "(DIR/tasks.jsonl) instead of profiling anew; repeatable.")
@SET_OPTION
def profile(file: str, overrides: tuple[str, ...], output: str | None, iterations: int, from_runs: tuple[str, ...],
            sets: tuple[str, ...]) -> None:
    """Measure the stages of the pipeline in FILE on this machine, for the planner.

    Runs the pipeline for a few iterations on the embedded cluster under each
    worker layout (workers x torch threads that fit the cores) and two plans,
    records how long every stage takes on how many rows, and writes a profile
    (JSON: the machine, the model shapes, every measured task). `placement:
    auto` then predicts from it. With --from-run, the task intervals of
    finished runs are added to the existing profile instead, so every run can
    refine it.

    \b
    Example:
      rlhfflow profile configs/grpo-small.yaml
      rlhfflow plan configs/grpo-small.yaml --candidates 5
      rlhfflow profile configs/grpo-small.yaml --from-run runs/grpo-small
    """
    pipeline = load(file, parse_sets(sets, overrides))
    from rlhfflow.plan.auto.costmodel import Profile, machine_info, model_shapes
    from rlhfflow.plan.auto.planner import default_profile_path
    from rlhfflow.runtime.profiler import observations_from_run, profile_pipeline

    path = Path(output) if output else default_profile_path(pipeline)
    if pipeline.spec.data is None:
        raise UserError(f"{file}: the pipeline has no iterations to profile (no 'data')")
    with pipeline_errors():
        if from_runs:
            found = Profile.load(path) if path.exists() else Profile(
                pipeline.name, machine_info(),
                {m: s.__dict__ for m, s in model_shapes(pipeline).items()})
            for run_dir in from_runs:
                added = observations_from_run(Path(run_dir))
                if not added:
                    raise UserError(f"{run_dir}: no task intervals (tasks.jsonl) to add")
                found.observations += added
                click.echo(f"added {len(added)} task(s) from {run_dir}")
        else:
            found = profile_pipeline(pipeline, iterations=iterations,
                                     say=lambda line: click.echo(line, err=True))
        found.save(path)
    click.echo(f"profile: {len(found.observations)} measured task(s) of "
               f"{len(found.shapes)} model(s) on {found.machine.get('cpu')} "
               f"({found.machine.get('cores')} cores) -> {path}")
