"""The ``rlhfflow`` command: check, draw, scaffold and run pipelines; inspect buffers.

One module per command beside this one (``validate``, ``graph``, ``plan``, ``profile``,
``init``, ``run``, ``stages``, ``buffer``, ``report``, ``warm``, ``models``, ``serve``);
this one holds the group and hands ``rlhfflow run`` to a warm server when one is up.
Pipeline and model code (torch, transformers, Dask) is imported inside the commands that
need it, so ``rlhfflow --help`` and ``rlhfflow buffer inspect`` start quickly.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import click

from rlhfflow import __version__
from rlhfflow.cli import (
    buffer,
    graph,
    init,
    models,
    plan,
    profile,
    report,
    run,
    serve,
    stages,
    validate,
    warm,
)
from rlhfflow.cli.common import SetsGroup, UserError, configure_logging, first_line
from rlhfflow.errors import RlhfflowError

#: the group's own flags, which may stand before the command
GROUP_FLAGS = ("-q", "--quiet", "-v", "--verbose")


class _Commands(SetsGroup):
    """The ``rlhfflow`` group: from the command line, ``rlhfflow run`` is handed to a
    warm server when one is up (``rlhfflow.launch.warm``). Every command's rlhfflow
    error (``rlhfflow.errors``) becomes its one line and exit code here: 2 for a user's
    mistake, 1 for a run that cannot go on. ``--set KEY VALUE`` is caught (``SetsGroup``)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RlhfflowError as exc:
            error = click.ClickException(first_line(exc))
            error.exit_code = exc.exit_code
            raise error from None

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:
        if args is None:  # the command line (an explicit list: a test, or the warm fork)
            import sys

            _run_warm(sys.argv[1:])
        return super().main(args, prog_name, **extra)


def _run_warm(argv: list[str]) -> None:
    """``rlhfflow run ...`` as a fork of the warm server (started first if none is up),
    exiting as it exits. Returns (the run goes on in this process) when the warm server
    is off or cannot start."""
    command = [a for a in argv if a not in GROUP_FLAGS][:1]
    if command != ["run"] or any(a in ("-h", "--help", "--supervise") for a in argv):
        return
    from rlhfflow.launch import warm, warmrun

    if not warm.enabled():
        return
    try:
        sock = warm.socket_path()
        if not warm.connectable(sock):
            if warm.start_server(sock, warm.idle_seconds()):
                click.echo(f"rlhfflow: starting a warm server: it imports torch, "
                           f"transformers and Dask once, and later runs start from it in "
                           f"~2 s (it exits after {warm.idle_seconds():.0f} s unused; "
                           f"{warm.ENV_VAR}=0 turns it off)", err=True)
            warm.wait_ready(sock, warm.READY_TIMEOUT_S)
    except (OSError, RuntimeError) as exc:  # run here, as without it
        click.echo(f"rlhfflow: running without a warm server: {first_line(exc)}", err=True)
        return
    try:
        code = warmrun.run_in_server(sock, argv)
    except OSError as exc:
        click.echo(f"rlhfflow: running without a warm server: {first_line(exc)}", err=True)
        return
    if code < 0:  # died from a signal: so does this process, for whoever waits on it
        if -code != signal.SIGKILL:  # (its handler cannot be set: OSError)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    raise SystemExit(code)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="rlhfflow")
@click.option("-q", "--quiet", is_flag=True,
              help="Print warnings and results only, no progress lines.")
@click.option("-v", "--verbose", is_flag=True,
              help="Print debug lines too (every task submitted, with its workers).")
def main(quiet: bool, verbose: bool) -> None:
    """RLHF pipelines written in YAML, run as dataflow on Dask.

    \b
    Example:
      rlhfflow init demo
      rlhfflow validate demo/pipeline.yaml
      rlhfflow graph demo/pipeline.yaml --format mermaid
      rlhfflow run demo/pipeline.yaml --iterations 5
    """
    if quiet and verbose:
        raise UserError("--quiet and --verbose both given; keep one")
    configure_logging("quiet" if quiet else "verbose" if verbose else "normal")


for command in (validate.validate, graph.graph, plan.plan, profile.profile, init.init,
                run.run, stages.stages, stages.stage, buffer.buffer, report.report,
                warm.warm, models.models, serve.serve):
    main.add_command(command)


if __name__ == "__main__":
    main(prog_name="rlhfflow")
