"""The reference of stage types, built from the classes themselves: what each reads and
writes, its capabilities, and its params with their ``Field(description=...)``.

One source for ``rlhfflow stages``, the page ``docs/reference/stages.md`` (which
``tests/test_docs.py`` keeps equal to ``render_markdown(builtin_only=True)``) and the
validator, which checks the same pydantic models.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticUndefined

from rlhfflow.sdk.registry import (
    BROKEN_PLUGINS,
    PLUGIN_SOURCES,
    known_stage_types,
    stage_type_path,
)
from rlhfflow.sdk.stage import Column, Stage

CAPABILITIES = ("generates", "samples", "scores", "trains", "reports", "once", "per_batch")


@dataclass(frozen=True)
class ParamDoc:
    """One field of a stage's params."""

    name: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class TypeDoc:
    """One stage type as the reference shows it; ``error`` is set for a broken plugin."""

    name: str
    path: str
    source: str
    summary: str = ""
    model: str = ""
    capabilities: tuple[str, ...] = ()
    reads: str = ""
    writes: str = ""
    params: tuple[ParamDoc, ...] = ()
    error: str = ""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', origin)}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _params(cls: type[Stage]) -> tuple[ParamDoc, ...]:
    out = []
    for name, info in cls.Params.model_fields.items():
        if info.default is PydanticUndefined and info.default_factory is None:
            default = "required"
        elif info.default_factory is not None:
            # a params field's factory takes no arguments (none reads the validated data)
            factory = typing.cast("Callable[[], object]", info.default_factory)
            default = repr(factory())
        else:
            default = repr(info.default)
        out.append(ParamDoc(name, _type_name(info.annotation), default,
                            info.description or ""))
    return tuple(out)


def _columns(cls: type[Stage], algorithm: Any) -> tuple[str, str]:
    """Reads and writes under the default params (they may change with the params)."""
    has_model = cls.model_head is not None and not cls.model_optional
    try:
        params = cls.Params()
        reads = cls.reads(params, algorithm, has_model)
        writes = cls.writes(params, algorithm, has_model)
    except Exception:  # noqa: BLE001  (required params or an algorithm it needs)
        return "depends on params", "depends on params"
    return ", ".join(reads) or "-", ", ".join(_column(n, c) for n, c in writes.items()) or "-"


def _column(name: str, col: Column) -> str:
    shape = f"[{col.length}]" if col.length else ""
    return f"{name} ({col.dtype}{shape})"


def _summary(cls: type[Stage]) -> str:
    doc = " ".join((cls.__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".") + "." if doc else ""


def describe_stage_types(algorithm: Any = None, builtin_only: bool = False) -> list[TypeDoc]:
    """Every stage type, sorted by name: built-ins, installed plugins and broken plugins.

    ``algorithm`` (an ``AlgorithmSpec``) is what stages whose columns depend on the
    algorithm (``advantages``) are described under.
    """
    docs = []
    for name, cls in known_stage_types().items():
        source = PLUGIN_SOURCES.get(name, "?")
        if builtin_only and source != "rlhfflow":
            continue
        reads, writes = _columns(cls, algorithm)
        model = cls.model_head or ""
        if model and cls.model_optional:
            model += " (optional)"
        docs.append(TypeDoc(
            name=name, path=stage_type_path(cls), source=source, summary=_summary(cls),
            model=model, capabilities=tuple(c for c in CAPABILITIES if getattr(cls, c)),
            reads=reads, writes=writes, params=_params(cls)))
    if not builtin_only:
        docs += [TypeDoc(name=n, path="", source="", error=e) for n, e in BROKEN_PLUGINS.items()]
    return sorted(docs, key=lambda d: d.name)


def render_text(docs: list[TypeDoc]) -> str:
    """The reference as ``rlhfflow stages`` prints it."""
    lines: list[str] = []
    for d in docs:
        if d.error:
            lines += [f"{d.name}  BROKEN: {d.error}", ""]
            continue
        origin = "built-in" if d.source == "rlhfflow" else f"from {d.source}"
        lines.append(f"{d.name}  ({d.path}, {origin})")
        if d.summary:
            lines.append(f"  {d.summary}")
        if d.model:
            lines.append(f"  model:   {d.model}")
        if d.capabilities:
            lines.append(f"  roles:   {', '.join(d.capabilities)}")
        lines.append(f"  reads:   {d.reads}")
        lines.append(f"  writes:  {d.writes}")
        if d.params:
            lines.append("  params:")
            for p in d.params:
                lines.append(f"    {p.name}: {p.type} = {p.default}")
                if p.description:
                    lines.append(f"        {p.description}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_markdown(docs: list[TypeDoc]) -> str:
    """The reference as Markdown (the body of ``docs/reference/stages.md``)."""
    lines: list[str] = []
    for d in docs:
        if d.error:
            lines += [f"### `{d.name}` (broken)", "", d.error, ""]
            continue
        lines += [f"### `{d.name}`", "", f"`{d.path}`. {d.summary}".rstrip(), ""]
        if d.model:
            lines.append(f"- model: `{d.model}`")
        if d.capabilities:
            lines.append(f"- roles: {', '.join(d.capabilities)}")
        lines.append(f"- reads: {d.reads}")
        lines.append(f"- writes: {d.writes}")
        lines.append("")
        if d.params:
            lines += ["| param | type | default | description |", "|---|---|---|---|"]
            for p in d.params:
                desc = p.description.replace("|", "\\|")
                lines.append(f"| `{p.name}` | `{p.type}` | `{p.default}` | {desc} |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"
