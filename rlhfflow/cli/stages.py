"""``rlhfflow stages`` (the stage types) and ``rlhfflow stage test FILE STAGE``."""

from __future__ import annotations

from pathlib import Path

import click

from rlhfflow import errors
from rlhfflow.cli.common import (
    OVERRIDES_ARGUMENT,
    SET_OPTION,
    SetsGroup,
    first_line,
    load,
    parse_sets,
    pipeline_errors,
)


@click.command("stages")
@click.option("--format", "fmt", type=click.Choice(["text", "markdown"]), default="text",
              show_default=True, help="Plain text, or Markdown (as in docs/reference/stages.md).")
@click.option("--builtin-only", is_flag=True,
              help="Only rlhfflow's own types, not those of installed plugins.")
def stages(fmt: str, builtin_only: bool) -> None:
    """List the stage types: built-in, installed plugins (the ``rlhfflow.stages``
    entry-point group) and plugins that failed to load, with what each reads and
    writes, its roles and its params.

    \b
    Example:
      rlhfflow stages
    """
    from rlhfflow.config.spec import AlgorithmSpec
    from rlhfflow.sdk.reference import (
        describe_stage_types,
        render_markdown,
        render_text,
    )

    docs = describe_stage_types(AlgorithmSpec(), builtin_only=builtin_only)
    click.echo((render_markdown if fmt == "markdown" else render_text)(docs), nl=False)


@click.group(cls=SetsGroup)
def stage() -> None:
    """Work with one stage of a pipeline.

    \b
    Example:
      rlhfflow stage test dag.yaml reward --iteration 2
    """


@stage.command("test")
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("stage_name", metavar="STAGE")
@OVERRIDES_ARGUMENT
@click.option("--iteration", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="K", help="The iteration whose prompts (and seeds) to use.")
@SET_OPTION
def stage_test(file: str, stage_name: str, overrides: tuple[str, ...], iteration: int,
               sets: tuple[str, ...]) -> None:
    """Run STAGE of FILE in this process on one iteration's batch, running the stages
    it waits for first, and print the columns it wrote (like ``airflow tasks test``);
    a multi-turn stage (rollout) also prints its first episodes turn by turn.

    Models start from their initial weights; nothing is written to the run's output.
    KEY=VALUE arguments after STAGE override keys of the file, like --set (e.g. one
    file, two checkpoints to evaluate).

    \b
    Example:
      rlhfflow stage test configs/grpo-tiny.yaml reward --iteration 1
      rlhfflow stage test eval.yaml evaluate models.actor.path=runs/a/models/actor/final
    """
    import tempfile
    import traceback

    pipeline = load(file, parse_sets(sets, overrides))
    from rlhfflow.runtime.stagetest import format_columns, format_episodes, run_stage_alone

    with tempfile.TemporaryDirectory(prefix="rlhfflow-stage-test-") as tmp:
        try:
            with pipeline_errors():
                result = run_stage_alone(pipeline, stage_name, iteration, Path(tmp))
        except (click.ClickException, errors.UserError):  # a mistake: one line, exit 2
            raise
        except Exception as exc:  # the stage's own failure: its traceback is what helps
            traceback.print_exc()
            raise click.ClickException(f"stage {stage_name!r} failed: "
                                       f"{first_line(exc)}") from None
    click.echo(format_columns(result), nl=False)
    click.echo(format_episodes(result), nl=False)
