"""``rlhfflow report RUN``: one self-contained HTML file about a run."""

from __future__ import annotations

import click

from rlhfflow.cli.common import UserError


def _iteration_list(text: str | None) -> list[int] | None:
    """``"3"``, ``"2,5"`` or ``"2-4"`` (and mixes: ``"0,3-5"``) as sorted iterations."""
    if not text:
        return None
    chosen: set[int] = set()
    for item in text.split(","):
        first, _, last = item.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise UserError(f"--iterations: expected iterations like 3, 2,5 or 2-4, got "
                            f"{text!r}")
        chosen.update(range(int(first), int(last or first) + 1))
    return sorted(chosen)


@click.command()
@click.argument("run_dir", metavar="RUN", type=click.Path())
@click.option("--out", type=click.Path(dir_okay=False), metavar="FILE",
              help="Where to write the report (default: RUN/report.html).")
@click.option("--iterations", metavar="LIST",
              help="Iterations whose per-worker timeline is drawn: 3, 2,5 or 2-4 "
                   "(default: the second and the last).")
@click.option("--samples", type=click.IntRange(min=0), default=3, show_default=True,
              help="Responses shown per iteration (of up to 10 iterations).")
def report(run_dir: str, out: str | None, iterations: str | None, samples: int) -> None:
    """Write a self-contained HTML report of the run in RUN (its output directory):
    reward/KL/length curves, time per stage, worker busy fractions, a per-worker
    timeline of chosen iterations, sample responses and the end of each worker's log
    (RUN/logs: what the run's code printed there). Works on a finished run and on one
    still running.

    \b
    Example:
      rlhfflow report runs/grpo-tiny --iterations 5,10
    """
    from rlhfflow.monitor.report import write_report

    # a ReportError is an rlhfflow UserError: the group says it in one line, exit 2
    path = write_report(run_dir, out, _iteration_list(iterations), samples)
    click.echo(f"wrote {path}")
