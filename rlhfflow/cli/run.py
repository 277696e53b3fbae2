"""``rlhfflow run FILE``: run a pipeline on Dask (or supervise a run that does)."""

from __future__ import annotations

import shlex
import signal
import threading
from pathlib import Path
from typing import Any

import click

from rlhfflow.cli.common import (
    OVERRIDES_ARGUMENT,
    SET_OPTION,
    UserError,
    load,
    merge_options,
    parse_sets,
    pipeline_errors,
)


def _embedded_cluster(file: str, scheduler: str | None) -> bool:
    """Whether FILE (at a glance: it is validated later) runs on an embedded cluster."""
    if scheduler:
        return False
    try:
        import yaml

        data = yaml.safe_load(Path(file).read_text(encoding="utf-8"))
        cluster = data.get("cluster") or {}
        return not cluster.get("address")
    except Exception:  # noqa: BLE001 - a broken file: load() says what is wrong
        return False


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@OVERRIDES_ARGUMENT
@click.option("--iterations", type=click.IntRange(min=0), metavar="N",
              help="Run N iterations instead of the file's 'iterations'.")
@click.option("--workers", type=click.IntRange(min=1), metavar="N",
              help="Start N local Dask workers instead of the file's 'cluster.workers'.")
@click.option("--out", type=click.Path(file_okay=False), metavar="DIR",
              help="Write checkpoints, experience and metrics to DIR instead of 'output'.")
@click.option("--scheduler", metavar="tcp://HOST:PORT",
              help="Use a running Dask scheduler instead of starting a local cluster.")
@click.option("--overwrite", is_flag=True,
              help="Start afresh, deleting an earlier run's checkpoints, experience and "
                   "metrics in the output directory.")
@click.option("--resume", type=click.Choice(["auto", "yes", "no"]), default="auto",
              is_flag=False, flag_value="yes", show_default=True,
              help="Continue the run in the output directory from its last checkpoint. "
                   "auto: when there is one; --resume alone: it must be there; no: refuse "
                   "an output directory that holds a run.")
@click.option("--force", is_flag=True,
              help="Resume even though the pipeline file changed since the run started.")
@click.option("--quiet", is_flag=True, help="Print no progress, only the result.")
@click.option("--supervise", is_flag=True,
              help="Run the coordinator as a child process and restart it (resuming from "
                   "the last checkpoint) when it dies, up to --max-restarts times.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              metavar="N", help="With --supervise: restarts of a dead coordinator before "
                                "giving up.")
@SET_OPTION
def run(file: str, overrides: tuple[str, ...], iterations: int | None, workers: int | None,
        out: str | None, scheduler: str | None, overwrite: bool, resume: str, force: bool,
        quiet: bool, supervise: bool, max_restarts: int, sets: tuple[str, ...]) -> None:
    """Run the pipeline in FILE on Dask.

    Options override the matching keys of the file, which is validated with
    them applied. An output directory holding a run of the same pipeline is
    resumed from its last checkpoint, so a run that was stopped or killed goes
    on where it left off. Ctrl-C (or SIGTERM) finishes the iteration in flight,
    saves a checkpoint and exits 130; a second Ctrl-C stops at once. Exits 2 on
    a mistake in the file and 1 when the run fails.

    With --supervise the run is a child process, restarted when it dies from a
    signal (or fails after committing an iteration), resuming from its last
    checkpoint; not after a clean finish, a mistake (2) or a stop (130).

    \b
    Example:
      rlhfflow run configs/ppo-tiny.yaml --iterations 5 --out runs/try --overwrite
      rlhfflow run configs/ppo-tiny.yaml --iterations 50      # continue to 50
      rlhfflow run configs/grpo-tiny.yaml --scheduler tcp://10.0.0.5:8786
      rlhfflow run configs/ppo-tiny.yaml --set overlap.max_staleness=1 \\
          --set placement.strategy=disaggregated
      rlhfflow run configs/ppo-tiny.yaml --supervise --max-restarts 5
    """
    source = click.get_current_context().get_parameter_source("max_restarts")
    if not supervise and source is not click.core.ParameterSource.DEFAULT:
        raise UserError("--max-restarts bounds the restarts of --supervise; add --supervise")
    if not supervise and _embedded_cluster(file, scheduler):
        # the workers' imports start now, before this process imports anything heavy
        # (--set values are read with the spec's YAML loader, which imports the stages),
        # and run beside its own (read on in rlhfflow.launch.forkserver)
        from rlhfflow.launch.forkserver import start_fork_server

        start_fork_server()
    settings = merge_options(parse_sets(sets, overrides), {
        "iterations": ("--iterations", iterations), "cluster.workers": ("--workers", workers),
        "output": ("--out", out), "cluster.address": ("--scheduler", scheduler)})
    pipeline = load(file, settings)
    from rlhfflow.runtime.runstate import output_lock

    if supervise:
        from rlhfflow.cli.supervise import supervise as supervise_run

        options = [file, *(f"--set={item}" for item in (*sets, *overrides))]
        for flag, value in (("--iterations", iterations), ("--workers", workers),
                            ("--out", out), ("--scheduler", scheduler)):
            if value is not None:
                options.append(f"{flag}={value}")
        options += ["--force"] * force + ["--quiet"] * quiet
        # a restart resumes whatever the first attempt left; never wipes it again
        first = [*options, f"--resume={resume}", *["--overwrite"] * overwrite]
        # held between attempts too (no other run slips in); each child shares it.
        # OutputInUse, like every rlhfflow error, is said by the group (cli.main)
        with output_lock(pipeline.output_dir) as lock:
            code = supervise_run(first, [*options, "--resume=auto"], pipeline.output_dir,
                                 max_restarts, lambda line: click.echo(line, err=True), lock)
        raise SystemExit(code)
    from rlhfflow.runtime.run import run_pipeline

    stop = threading.Event()
    previous = _install_stop_handlers(stop, quiet)
    try:
        with pipeline_errors():
            result = run_pipeline(pipeline, progress=not quiet, overwrite=overwrite,
                                  resume=resume, force=force, stop=stop)
    except KeyboardInterrupt:
        # the cluster was closed on the way out; committed iterations stay valid, the one
        # in flight was never committed and is ignored by every reader
        click.echo("interrupted at once: the iteration in flight was abandoned; the run "
                   "resumes from its last checkpoint", err=True)
        raise SystemExit(130) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if result.already_done is not None:
        click.echo(f"nothing to do: {result.output_dir} already has {result.already_done} "
                   f"iterations")
        return
    if result.metrics:  # the scalars of the last iteration; the rest is in the output
        last = result.metrics[-1]
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in last.items() if isinstance(v, int | float))
        click.echo(f"last iteration: {shown}")
    click.echo(f"output: {result.output_dir}")
    if result.stopped:
        given = {"--iterations": iterations, "--workers": workers, "--out": out,
                 "--scheduler": scheduler}
        again = continue_command(file, (*sets, *overrides), given, force)
        click.echo(f"stopped early; checkpoint saved; continue with: {again}", err=True)
        raise SystemExit(130)


def continue_command(file: str, sets: tuple[str, ...], options: dict[str, Any],
                     force: bool) -> str:
    """The command that continues a stopped run: the same file and options (not
    ``--overwrite``, which would start it again), quoted for a shell."""
    words = ["rlhfflow", "run", file]
    for item in sets:
        words += ["--set", item]
    for flag, value in options.items():
        if value is not None:
            words += [flag, str(value)]
    words += ["--force"] * force
    return shlex.join(words)


def _install_stop_handlers(stop: threading.Event, quiet: bool) -> dict[int, Any]:
    """First Ctrl-C / SIGTERM: finish the iteration in flight and stop; second: at once."""
    def handle(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        if not quiet:
            click.echo("\nrlhfflow: stop requested; finishing the iteration in flight "
                       "(Ctrl-C again to stop at once)", err=True)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, handle)
    return previous
