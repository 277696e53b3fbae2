"""``rlhfflow plan FILE``: the execution plan and its predicted iteration time, without running."""

from __future__ import annotations

from pathlib import Path

import click

from rlhfflow.cli.common import (
    OVERRIDES_ARGUMENT,
    SET_OPTION,
    load,
    merge_options,
    parse_sets,
    pipeline_errors,
)


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@OVERRIDES_ARGUMENT
@click.option("--workers", type=click.IntRange(min=1), metavar="N",
              help="Plan for N device workers (any number: with a profile measured on "
                   "their kind of device, a cluster larger than this machine) instead of "
                   "the file's 'cluster.workers'.")
@click.option("--strategy", type=click.Choice(["auto", "colocated", "interleaved",
                                                "disaggregated"]),
              help="Plan with this strategy instead of the file's 'placement.strategy'.")
@click.option("--candidates", type=click.IntRange(min=0), default=0, metavar="N",
              help="With strategy auto, also list the N runners-up with their predicted "
                   "iteration times and why they lose.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Predict with this profile instead of 'placement.profile' (default "
                   "profiles/NAME.json beside the pipeline file, if there is one).")
@click.option("--explain", "explain_stage", metavar="STAGE",
              help="Instead of the plan, say why each task of STAGE waits, for what: every "
                   "wait with the rule that made it (iteration 1, as every later one).")
@SET_OPTION
def plan(file: str, overrides: tuple[str, ...], workers: int | None, strategy: str | None,
         candidates: int, profile_path: str | None, explain_stage: str | None, sets: tuple[str, ...]) -> None:
    """Print the execution plan of a pipeline FILE without running it.

    For every stage: the workers it runs on and how its batch is split among
    them; for every model: the workers that hold it; the overlap (which stages
    run ahead with max_staleness, which are fused into one task); which
    weights move where after each update; the predicted iteration time and a
    timeline of one iteration per worker. With strategy auto (the default) the
    planner's choice is shown, and --candidates N lists the runners-up. A
    placement the cluster cannot hold is an error (exit 2).

    \b
    Example:
      rlhfflow plan configs/ppo-tiny.yaml --candidates 5
      rlhfflow plan configs/ppo-tiny.yaml --strategy disaggregated --workers 4
      rlhfflow plan configs/grpo-small.yaml --workers 64 --profile gpu.json
      rlhfflow plan configs/ppo-tiny.yaml --strategy disaggregated \\
          --set overlap.max_staleness=1
      rlhfflow plan configs/ppo-tiny.yaml --explain train_critic
    """
    settings = merge_options(parse_sets(sets, overrides), {
        "cluster.workers": ("--workers", workers),
        "placement.strategy": ("--strategy", strategy),
        "placement.profile": ("--profile", str(Path(profile_path).resolve())
                              if profile_path is not None else None)})
    pipeline = load(file, settings)
    from rlhfflow.plan.auto.planner import describe_choice, load_profile, plan_for_cli
    from rlhfflow.plan.describe import plan_text

    with pipeline_errors():
        profile = load_profile(pipeline)
        choice = plan_for_cli(pipeline, profile, workers)
        if explain_stage is not None:
            from rlhfflow.plan.explain import explain

            lines = explain(choice.pipeline, choice.best.plan, explain_stage)
            click.echo(f"plan: {choice.best.plan.strategy} on {choice.best.plan.n_workers} "
                       f"worker(s)")
            click.echo("\n".join(lines))
            return
        click.echo(plan_text(choice.best.plan, choice.pipeline))
        click.echo("\n".join(describe_choice(choice, profile, candidates)))
