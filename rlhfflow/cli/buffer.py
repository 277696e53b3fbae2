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
    from rlhfflow.storage.buffer import ExperienceBuffer

    try:
        buf = ExperienceBuffer(path, create=False)
    except FileNotFoundError as exc:
        raise UserError(first_line(exc)) from None
    click.echo(format_summary(buf.summary(), buf.uncommitted()), nl=False)


def _fmt_number(value: float | None) -> str:
    """Compact fixed-width-friendly number: '-' for missing, 4 significant digits."""
    if value is None:
        return "-"
    return f"{value:.4g}"


def format_summary(summary: list[dict], uncommitted: list[int] | None = None) -> str:
    """Human-readable table of :meth:`ExperienceBuffer.summary` for ``rlhfflow buffer inspect``.

    One block per committed iteration with a line per column (name, shape, dtype,
    mean/std/min/max), then one line per uncommitted group, flagged
    ``incomplete (ignored)`` because readers never see it.
    """
    from rlhfflow.storage.buffer import RESERVED_ATTRS, group_name

    lines: list[str] = []
    header = ("column", "shape", "dtype", "mean", "std", "min", "max")
    for item in summary:
        extra = {k: v for k, v in item.get("attrs", {}).items() if k not in RESERVED_ATTRS}
        title = f"iteration {item['iteration']}  rows={item['rows']}"
        lines.append(title + (f"  attrs={extra}" if extra else ""))
        rows = [header] + [
            (
                name,
                "x".join(str(d) for d in col["shape"]),
                col["dtype"],
                *(_fmt_number(col[k]) for k in ("mean", "std", "min", "max")),
            )
            for name, col in item["columns"].items()
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            cells = [
                cell.ljust(w) if i < 3 else cell.rjust(w)  # text left, numbers right
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells).rstrip())
        lines.append("")
    if not summary:
        lines.append("no committed iterations")
    for it in uncommitted or []:
        lines.append(f"{group_name(it)}: incomplete (ignored)")
    return "\n".join(lines).rstrip() + "\n"


# -- read-side helpers for stages ---------------------------------------------------------
