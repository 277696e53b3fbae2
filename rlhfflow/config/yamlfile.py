"""Reading a pipeline file: YAML as users write it (``1e-5`` is a float, a duplicate key
is a mistake), ``--set`` overrides by dotted key, and pydantic's validation errors said
as one line: ``FILE: KEY.PATH: what was expected``, with a "did you mean" where a name
is close to a known one."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ValidationError

from rlhfflow.errors import SpecError, did_you_mean

# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """Safe YAML (no object construction) that also reads ``1e-5`` as a float, as
    every user expects; YAML 1.1 alone would read it as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$"
               r"|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)
# ...but plain integers stay integers: the int resolver must be tried first.
_Loader.yaml_implicit_resolvers = {
    k: sorted(v, key=lambda r: r[0] != "tag:yaml.org,2002:int")
    for k, v in _Loader.yaml_implicit_resolvers.items()
}


def _check_duplicate_keys(loader: _Loader, node: yaml.MappingNode) -> None:
    """PyYAML keeps the last of two equal keys silently; in a pipeline that hides a whole
    stage or model, so it is an error (merge keys ``<<`` may repeat keys on purpose).

    Keys are compared by the value they load as, not their spelling: ``1`` and ``0x1``, or
    ``yes`` and ``true``, are one dict key and would overwrite each other just the same.
    """
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        value = key_node.value if key_node.tag == "tag:yaml.org,2002:str" else \
            loader.construct_object(key_node)
        key = value  # as a dict key: 1, 1.0 and true collide in Python too
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key_node.value!r} (first at line "
                f"{seen[key].line + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> typing.Iterator[dict[Any, Any]]:
    _check_duplicate_keys(loader, node)
    yield from yaml.constructor.SafeConstructor.construct_yaml_map(loader, node)


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)

_TYPE_NAMES = {"list": "a list", "str": "a string", "int": "a number", "float": "a number",
               "bool": "true/false"}


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: where, what, and the construct it was inside."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    tag = re.fullmatch(r"could not determine a constructor for the tag '(.*)'", problem)
    if tag:
        name = tag[1].replace("tag:yaml.org,2002:", "!!")
        return (f"{where}unsupported tag {name!r}; pipeline files hold plain data "
                f"(mappings, lists, strings, numbers)")
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark and mark and context_mark.line != mark.line:
        problem += (f" ({context} started at line {context_mark.line + 1}, "
                    f"column {context_mark.column + 1})")
    return where + problem


def read_yaml(file: Path) -> dict[str, Any]:
    """Read a YAML mapping safely; any problem is a one-line SpecError."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(file, "", "file not found") from None
    except IsADirectoryError:
        raise SpecError(file, "", "is a directory, expected a YAML file") from None
    except UnicodeDecodeError as exc:
        raise SpecError(file, "", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(file, "", f"cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        raise SpecError(file, "", f"invalid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        raise SpecError(file, "", "the file is empty; expected a mapping with at least "
                                  "'stages'")
    if not isinstance(data, dict):
        got = _TYPE_NAMES.get(type(data).__name__, type(data).__name__)
        raise SpecError(file, "", f"expected a mapping of keys (name:, models:, stages:, ...) "
                                  f"at the top level, got {got}")
    return data


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``cluster.workers``) in a raw spec; used by CLI options."""
    data = dict(data)
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            child = node.get(key)
            child = dict(child) if isinstance(child, dict) else {}
            node[key] = child
            node = child
        node[last] = value
    return data


# --------------------------------------------------------------------------- errors


def key_path(loc: tuple[Any, ...]) -> str:
    """``('stages', 'reward', 'after', 0)`` -> ``stages.reward.after[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that holds the key at ``loc`` (to suggest its fields)."""
    current: Any = root
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = next((f for n, f in current.model_fields.items()
                          if part in (n, f.alias)), None)
            if field is None:
                return None
            current = field.annotation
        elif isinstance(part, (str, int)):
            args = [a for a in typing.get_args(current) if a is not type(None)]
            current = args[-1] if args else None
        while typing.get_origin(current) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(current) if a is not type(None)]
            current = args[0] if args else None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _number_kind(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """``"an integer"`` or ``"a number"``: what the field at ``loc`` holds."""
    parent = _model_at(root, loc)
    field = next((f for n, f in parent.model_fields.items() if loc[-1] in (n, f.alias)),
                 None) if parent and loc else None
    annotation = field.annotation if field else None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return "an integer" if annotation is int else "a number"


_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


def _describe(value: Any) -> str:
    text = repr(value)
    return (text[:40] + "...") if len(text) > 43 else text


def error_from_pydantic(file: Path, exc: ValidationError, root: type[BaseModel],
                        prefix: tuple[Any, ...] = ()) -> SpecError:
    """The first pydantic error as a one-line SpecError with a helpful message."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(p for p in err["loc"] if p not in ("function-after",))
    kind, value = err["type"], err.get("input")
    ctx = err.get("ctx", {})
    if "[key]" in loc:  # a mapping key that is not a string, e.g. `5:`
        loc = loc[:loc.index("[key]") - 1]
        message = f"expected every key to be a string, got {_describe(value)}"
    elif kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        limit = ctx.get(name)
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        message = f"expected {_number_kind(root, loc)} {op} {limit}, got {_describe(value)}"
    elif kind in ("too_short", "too_long"):
        bound = (f"at least {ctx.get('min_length')}" if kind == "too_short"
                 else f"at most {ctx.get('max_length')}")
        message = f"expected {bound} items, got {ctx.get('actual_length')}: {_describe(value)}"
    elif kind == "extra_forbidden":
        parent = _model_at(root, loc)
        hint = did_you_mean(str(loc[-1]), _field_names(parent)) if parent else ""
        allowed = f" (allowed: {', '.join(_field_names(parent))})" if parent and not hint else ""
        message = f"unknown key{hint}{allowed}"
    elif kind == "missing":
        message = "required key is missing"
    elif kind == "literal_error":
        expected = ctx.get("expected", "")
        message = f"expected one of {expected}, got {_describe(value)}"
    elif kind in ("int_type", "int_parsing", "int_from_float"):
        message = f"expected an integer, got {_describe(value)}"
    elif kind in ("float_type", "float_parsing"):
        message = f"expected a number, got {_describe(value)}"
    elif kind in ("bool_type", "bool_parsing"):
        message = f"expected true or false, got {_describe(value)}"
    elif kind in ("string_type",):
        message = f"expected a string, got {_describe(value)}"
    elif kind in ("dict_type", "model_type", "model_attributes_type"):
        message = f"expected a mapping, got {_describe(value)}"
    elif kind in ("list_type",):
        message = f"expected a list, got {_describe(value)}"
    elif kind == "value_error":
        message = str(ctx.get("error", err["msg"]))
    else:
        message = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {_describe(value)}"
    return SpecError(file, key_path(prefix + loc), message)
