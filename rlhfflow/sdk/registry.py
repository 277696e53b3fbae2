"""The registry of stage types: how a pipeline's ``type:`` finds its class.

Stage types are found three ways, all through ``resolve_stage_type``: the built-ins
(``rlhfflow.stages``) register themselves when imported, installed packages contribute
types through the ``rlhfflow.stages`` entry-point group (the built-ins are declared there
too), and a pipeline may name any ``Stage`` subclass by import path
(``mypkg.stages:CodeReward``). Workers create stages by import path
(``stage_type_path``), so a plugin type needs only to be importable on the workers, not
registered there.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import threading
from collections.abc import Mapping
from typing import Any

from rlhfflow.errors import UserError
from rlhfflow.sdk.stage import Stage

STAGE_TYPES: dict[str, type[Stage]] = {}
"""Registered stage types by name: the built-ins and the installed plugins that loaded."""

ENTRY_POINT_GROUP = "rlhfflow.stages"
BROKEN_PLUGINS: dict[str, str] = {}
"""Entry-point names whose plugin failed to load, with the cause (one line)."""
PLUGIN_SOURCES: dict[str, str] = {}
"""Registered name -> the distribution that declared it (``rlhfflow`` for built-ins)."""

_plugins_loaded = False
_plugins_lock = threading.Lock()


class StageTypeError(UserError, ValueError):
    """A stage type that cannot be used: unknown, not importable, or not a ``Stage``."""


def register_stage(cls: type[Stage]) -> type[Stage]:
    """Class decorator: make a stage type available to pipelines by its ``type_name``."""
    if not cls.type_name:
        raise ValueError(f"{cls.__name__} has no type_name")
    if cls.type_name in STAGE_TYPES and STAGE_TYPES[cls.type_name] is not cls:
        raise ValueError(f"stage type {cls.type_name!r} is registered twice")
    STAGE_TYPES[cls.type_name] = cls
    # a plugin may register by decorator too; only our own modules are "built-in"
    PLUGIN_SOURCES.setdefault(cls.type_name, cls.__module__.partition(".")[0])
    return cls


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_plugins() -> None:
    """Register the stage types of the ``rlhfflow.stages`` entry-point group (once).

    A plugin that fails to import, or names something that is not a ``Stage``, is kept
    in ``BROKEN_PLUGINS`` with its cause instead of raising, so one broken package does
    not hide the other types; a pipeline that uses it gets that cause as its error.
    """
    global _plugins_loaded
    with _plugins_lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            try:
                cls = ep.load()
            except Exception as exc:  # noqa: BLE001  (any import error is the plugin's)
                BROKEN_PLUGINS[ep.name] = f"{ep.value} ({dist}) failed to import: " \
                                          f"{_one_line(exc)}"
                continue
            if not (isinstance(cls, type) and issubclass(cls, Stage)):
                BROKEN_PLUGINS[ep.name] = f"{ep.value} ({dist}) is not a Stage subclass"
                continue
            existing = STAGE_TYPES.get(ep.name)
            if existing is cls and PLUGIN_SOURCES.get(ep.name) != "rlhfflow":
                PLUGIN_SOURCES[ep.name] = dist  # registered on import, declared here too
            if existing is not None and existing is not cls:
                # stale metadata of an editable install can point at the same class by
                # another route; only a different class under one name is a conflict
                if stage_type_path(existing) != stage_type_path(cls):
                    BROKEN_PLUGINS[ep.name] = (f"{ep.value} ({dist}) clashes with "
                                               f"{stage_type_path(existing)}, registered "
                                               f"under the same name")
                continue
            STAGE_TYPES[ep.name] = cls
            PLUGIN_SOURCES[ep.name] = dist


def known_stage_types() -> dict[str, type[Stage]]:
    """Every registered stage type (built-ins and installed plugins), by name."""
    load_plugins()
    return dict(STAGE_TYPES)


def stage_type_path(cls: type[Stage]) -> str:
    """The import path ``module:Class`` that workers use to create a stage of ``cls``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_stage_type(ref: str) -> type[Stage]:
    """The stage class ``ref`` names: a registered name (built-in or entry point) or an
    import path ``package.module:Class``. ``StageTypeError`` (one line) otherwise."""
    if ":" in ref:
        return _import_stage(ref)
    if ref in STAGE_TYPES:  # a built-in (or loaded) type: no need to import every plugin
        return STAGE_TYPES[ref]
    load_plugins()
    if ref in STAGE_TYPES:
        return STAGE_TYPES[ref]
    if ref in BROKEN_PLUGINS:
        raise StageTypeError(f"plugin stage type {ref!r}: {BROKEN_PLUGINS[ref]}")
    match = difflib.get_close_matches(ref, list(STAGE_TYPES), n=1, cutoff=0.6)
    hint = (f"; did you mean {match[0]!r}?" if match
            else f"; known: {', '.join(sorted(STAGE_TYPES))}")
    raise StageTypeError(f"unknown stage type {ref!r}{hint}")


def _import_stage(ref: str) -> type[Stage]:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise StageTypeError(f"expected a registered name or 'package.module:Class', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001  (a plugin's import error is reported, not raised)
        raise StageTypeError(f"cannot import module {module_name!r}: {_one_line(exc)}") \
            from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        raise StageTypeError(f"module {module_name!r} has no {attr!r}")
    if not (isinstance(obj, type) and issubclass(obj, Stage)):
        raise StageTypeError(f"{ref!r} is not a subclass of rlhfflow.stages.Stage")
    return obj


def get_stage_type(type_name: str) -> type[Stage]:
    """The stage class ``type_name`` names (see ``resolve_stage_type``); KeyError if none."""
    try:
        return resolve_stage_type(type_name)
    except StageTypeError as exc:
        raise KeyError(str(exc)) from None


def create_stage(type_name: str, name: str | None = None,
                 params: Mapping[str, Any] | None = None, algorithm: Any = None,
                 model: str | None = None, *, backend: str = "torch",
                 deepspeed: Mapping[str, object] | None = None) -> Stage:
    """Instantiate a stage by registered name or import path, validating ``params``;
    ``backend`` and ``deepspeed``: the stage's keys of those names (``Stage.use_backend``)."""
    cls = get_stage_type(type_name)
    stage = cls(name or cls.type_name or type_name, params, algorithm, model)
    if backend != "torch":  # the default: nothing to set
        stage.use_backend(backend, deepspeed)
    return stage
