"""User code named in a pipeline: ``module:attr`` or ``path/file.py:attr`` (reward
functions, environments, tools, agents), imported once per process and named in errors
by what the pipeline wrote."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlhfflow.ops.registry import load_callable

#: The module name a pipeline's own ``file.py`` is imported under (with a hash of its path,
#: which differs between processes: pickles send its objects by value).
USER_MODULE_PREFIX = "rlhfflow_user_"


def by_value(*objects: Any) -> None:
    """Have cloudpickle send ``objects`` that come from a file the pipeline names (its
    module imported under ``USER_MODULE_PREFIX`` and a name only this process knows) by
    value, so that another process (the CPU pool) need not import that file by name."""
    import cloudpickle

    for thing in objects:
        module = sys.modules.get(getattr(thing, "__module__", None) or "")
        if module is not None and module.__name__.startswith(USER_MODULE_PREFIX):
            cloudpickle.register_pickle_by_value(module)


def load_function(ref: str, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """Import the callable ``module:attr`` or ``path/file.py:attr``. Only the name the
    pipeline gives is imported; nothing is searched for."""
    return _load_function(ref, str(base_dir) if base_dir is not None else None)


@lru_cache(maxsize=64)
def _load_function(ref: str, base_dir: str | None) -> Callable[..., Any]:
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function' or 'file.py:function', got {ref!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise ValueError(f"reward file not found: {path}")
        unique = f"{USER_MODULE_PREFIX}{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(unique, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique] = module
        spec.loader.exec_module(module)
    else:  # an importable module: the same resolution as estimators and policy losses
        return load_callable(ref)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return fn


def imported(ref: str, base_dir: Path | str | None) -> tuple[str | None, Any]:
    """``(problem, object)``: what ``ref`` names, or one line on why it cannot be used."""
    module, sep, attr = ref.rpartition(":")
    if not sep or not module or not attr:
        return f"expected 'file.py:name' or 'package.module:name', got {ref!r}", None
    if module.endswith(".py"):
        path = Path(module) if Path(module).is_absolute() or base_dir is None \
            else Path(base_dir) / module
        if not path.is_file():
            return f"file not found: {path}", None
    try:
        return None, load_function(ref, base_dir)
    except Exception as exc:  # noqa: BLE001  (the user's module failed to import)
        lines = str(exc).strip().splitlines()
        return f"cannot import {ref!r}: {type(exc).__name__}: " \
               f"{lines[0] if lines else ''}", None
