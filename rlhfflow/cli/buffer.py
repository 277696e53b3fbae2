"""``rlhfflow buffer inspect PATH``: what an experience buffer holds."""

from __future__ import annotations

import click

from rlhfflow.cli.common import UserError, first_line


@click.group()
def buffer() -> None:
    """Look into experience buffers (OUTPUT/buffer.zarr).

    \b
    Example:
      rlhfflow buffer inspect runs/ppo-tiny/buffer.zarr
    """


@buffer.command("inspect")
@click.argument("path", type=click.Path(file_okay=False))
def buffer_inspect(path: str) -> None:
    """Print every committed iteration of the buffer at PATH, column by column.

    Shows each column's shape, dtype and mean/std/min/max (padding included),
    and lists iterations that were begun but never committed.

    \b
    Example:
      rlhfflow buffer inspect runs/ppo-tiny/buffer.zarr
    """
    from rlhfflow.storage.buffer import ExperienceBuffer, format_summary

    try:
        buf = ExperienceBuffer(path, create=False)
    except FileNotFoundError as exc:
        raise UserError(first_line(exc)) from None
    click.echo(format_summary(buf.summary(), buf.uncommitted()), nl=False)
