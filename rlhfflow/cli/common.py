"""What the commands share: the one-line user error, loading a pipeline file with its
``--set`` overrides, and plain-text tables."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rlhfflow.config.loader import Pipeline


class UserError(click.ClickException):
    """A mistake in what the user gave us (a pipeline file, a path): one line, exit 2."""

    exit_code = 2


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextmanager
def pipeline_errors() -> Iterator[None]:
    """Turn a path that is not there into a one-line ``UserError`` (a bad pipeline or
    data file is an ``rlhfflow.errors.UserError``, which the group turns into one)."""
    try:
        yield
    except FileNotFoundError as exc:
        raise UserError(first_line(exc)) from None


def load(file: str, overrides: dict[str, Any] | None = None) -> Pipeline:
    """``load_pipeline`` with user mistakes turned into ``UserError``."""
    from rlhfflow.config.loader import load_pipeline

    with pipeline_errors():
        return load_pipeline(file, overrides)


def parse_sets(values: tuple[str, ...], positional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``--set KEY=VALUE`` options and ``KEY=VALUE`` arguments after FILE (as veRL and
    Hydra take them) as overrides (VALUE read as YAML: 1, 0.5, true, [0, 1])."""
    if not values and not positional:  # the spec's loader imports the stages (torch)
        return {}
    import yaml

    from rlhfflow.config.yamlfile import _Loader

    out: dict[str, Any] = {}
    for item, as_option in [*((v, True) for v in values), *((v, False) for v in positional)]:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            if as_option:
                raise UserError(f"--set expects KEY=VALUE (e.g. overlap.max_staleness=1); "
                                f"got {item!r}")
            raise UserError(f"expected FILE and then KEY=VALUE overrides (e.g. "
                            f"algorithm.kl_coef=0.1); got {item!r}")
        key = key.strip()
        if key in out:  # the last one would win silently, like a duplicate key in the file
            raise UserError(f"--set {key}: given twice; keep one")
        try:
            out[key] = yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader
        except yaml.YAMLError as exc:
            # a duplicate key inside a flow mapping (--set 'overlap={a: 1, a: 2}') too
            problem = getattr(exc, "problem", None)
            detail = f" ({problem})" if problem and "duplicate key" in problem else ""
            raise click.BadParameter(f"{key}: the value {text!r} is not valid YAML{detail}",
                                     param_hint="--set") from None
    return out


def check_set_spacing(args: list[str]) -> None:
    """``--set iterations 5`` (a space for the ``=``, as argparse users write options):
    one line with the fix, before click reads ``5`` as an argument. ``args``: the
    command's own arguments, as typed."""
    for i, arg in enumerate(args):
        if arg == "--":
            return
        if arg == "--set":
            value, rest = (args[i + 1] if i + 1 < len(args) else None), args[i + 2:]
        elif arg.startswith("--set="):
            value, rest = arg[len("--set="):], args[i + 1:]
        else:
            continue
        if value is None or "=" in value:
            continue
        after = rest[0] if rest else ""
        looks_like_value = after and not after.startswith("-") and "=" not in after \
            and not after.endswith((".yaml", ".yml"))
        hint = f" (did you mean --set {value}={after}?)" if looks_like_value else ""
        raise UserError(f"--set expects KEY=VALUE; got {value!r}{hint}")


class SetsGroup(click.Group):
    """A group of commands that take ``--set``: ``--set KEY VALUE`` (a space for the
    ``=``) is one line with the fix, before the command's parser reads VALUE as one of
    its arguments."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None and any(p.name == "sets" for p in command.params):
            check_set_spacing(rest)
        return name, command, rest


def merge_options(sets: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """``--set`` overrides plus the dedicated options (``--iterations``...); one key given
    both ways is a mistake, not a silent choice of one of them."""
    for key, (flag, value) in options.items():
        if value is not None and key in sets:
            raise UserError(f"--set {key} and {flag} both given; keep one")
    return {**sets, **{k: v for k, (_, v) in options.items() if v is not None}}


#: ``KEY=VALUE`` overrides after FILE, as veRL and Hydra users write them: the same as --set
OVERRIDES_ARGUMENT = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")

SET_OPTION = click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE",
    help="Override any key of the file, as a dotted path and a YAML value; repeatable. "
         "E.g. --set overlap.max_staleness=1 --set placement.strategy=disaggregated, or "
         "the same as arguments after FILE: overlap.max_staleness=1")


def table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)
                               ).rstrip() for row in rows]


class _StderrHandler(logging.StreamHandler):
    """Writes each record to whatever ``sys.stderr`` is when it is emitted: click's test
    runner and the warm server's fork replace it after the handler exists."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


#: how loud the command line is: --quiet shows warnings only, --verbose every debug line
LEVELS = {"quiet": logging.WARNING, "normal": logging.INFO, "verbose": logging.DEBUG}


def configure_logging(loudness: str = "normal") -> None:
    """Print the ``rlhfflow`` logger's records on stderr as bare lines, at ``loudness``
    (one handler, however often this is called)."""
    logger = logging.getLogger("rlhfflow")
    handler = next((h for h in logger.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(LEVELS[loudness])
